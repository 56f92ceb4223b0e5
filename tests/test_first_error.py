"""The line that explains a failed launch (demo/first_error.py and launch_scripts/common.sh's
`run_and_explain`): the first error in the log, not torchrun's ChildFailedError at its end."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from nvcomp_ckpt_engine.demo.first_error import FirstError, first_error, main

ROOT = Path(__file__).resolve().parents[1]

#: The shape of a torchrun log where DeepSpeed's JIT build failed on every rank: the ranks'
#: tracebacks (prefixed and interleaved), then torchrun's own traceback and report.
TORCHRUN_LOG = """\
W1205 07:15:43.361000 3284 torch/distributed/run.py:874] *****************************************
[demo rank 0] starting DeepSpeed
[rank1]: Traceback (most recent call last):
[rank0]: Traceback (most recent call last):
[rank1]:   File "/venv/lib/python3.11/site-packages/deepspeed/ops/op_builder/builder.py", line 741, in compute_capability_args
[rank0]:   File "/venv/lib/python3.11/site-packages/deepspeed/runtime/engine.py", line 1400, in _configure_basic_optimizer
[rank0]:     optimizer = FusedAdam(
[rank0]:   File "/venv/lib/python3.11/site-packages/deepspeed/ops/op_builder/builder.py", line 741, in compute_capability_args
[rank0]:     minor = int(minor_part.split('+')[0])
[rank0]:             ^^^^^^^^^^^^^^^^^^^^^^^^^^^^^
[rank0]: ValueError: invalid literal for int() with base 10: '0a'
[rank1]:     minor = int(minor_part.split('+')[0])
[rank1]: ValueError: invalid literal for int() with base 10: '0a'
E1205 07:15:50.000000 3284 torch/distributed/elastic/multiprocessing/api.py:882] failed (exitcode: 1)
Traceback (most recent call last):
  File "/venv/bin/torchrun", line 8, in <module>
    sys.exit(main())
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
============================================================
nvcomp_ckpt_engine.demo FAILED
------------------------------------------------------------
Root Cause (first observed failure):
[0]:
  exitcode  : 1 (pid: 3290)
============================================================
"""


def test_the_first_traceback_explains_not_torchruns_report():
    found = first_error(TORCHRUN_LOG.splitlines())
    assert found == FirstError(
        11, "ValueError: invalid literal for int() with base 10: '0a'",
        'File "/venv/lib/python3.11/site-packages/deepspeed/ops/op_builder/builder.py", '
        'line 741, in compute_capability_args')
    assert "ChildFailedError" in TORCHRUN_LOG.splitlines()[-8]  # where the log ends


def test_an_error_line_without_a_traceback_and_a_clean_log():
    log = ["step 1 loss 5.7", "RuntimeError: runs/x/latest exists but DeepSpeed loaded nothing",
           "Traceback (most recent call last):", '  File "x.py", line 1', "KeyError: 'a'"]
    assert first_error(log) == FirstError(2, log[1])
    assert first_error(["step 1 loss 5.7", "FutureWarning: deprecated"]) is None


def test_main_prints_where_and_what(tmp_path, capsys):
    log = tmp_path / "reference.log"
    log.write_text(TORCHRUN_LOG)
    assert main([str(log)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == f"--- the first error in {log} (line 11):"
    assert "op_builder/builder.py" in out[1]
    assert out[2] == "ValueError: invalid literal for int() with base 10: '0a'"
    log.write_text("all good\n")
    assert main([str(log)]) == 1


def test_launch_scripts_show_the_first_error_last(tmp_path):
    """common.sh's `run_and_explain`: the command's output as it comes, its exit status, and on
    failure the first error as the last lines, after the failing command's own last words."""
    script = ("source launch_scripts/common.sh; "
              "run_and_explain \"$PYTHON\" -c 'import sys; print(\"step 1\", flush=True); "
              "int(\"0a\")'; echo \"status=$?\"")
    env = {**os.environ, "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ["PATH"]]),
           "PYTHON": sys.executable, "PYTHONPATH": str(ROOT), "TMPDIR": str(tmp_path)}
    done = subprocess.run(["bash", "-c", script], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=60)
    lines = done.stdout.splitlines()
    assert lines[0] == "step 1"
    assert lines[-2] == "ValueError: invalid literal for int() with base 10: '0a'"
    assert lines[-1] == "status=1"
    assert "--- the first error in the output above (line 4):" in done.stdout and "line 1, in <module>" in done.stdout
    assert not list(tmp_path.iterdir())  # the log is removed once shown
    script = "source launch_scripts/common.sh; run_and_explain true; echo \"status=$?\""
    done = subprocess.run(["bash", "-c", script], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=60)
    assert done.stdout == "status=0\n"
