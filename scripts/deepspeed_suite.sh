#!/usr/bin/env bash
# Runs DeepSpeed's own checkpoint tests twice on this machine -- once as they are, once with
# nvcomp_ckpt_engine turned on in every config they build -- and prints the tests whose outcome
# differs. DeepSpeed's test code is read from a checkout of its repository, never copied here.
#
#   usage: bash scripts/deepspeed_suite.sh DEEPSPEED_SOURCE_DIR [PYTEST_ARGS...]
#
# DEEPSPEED_SOURCE_DIR: a `git clone` of DeepSpeed (its release sdist has no tests), best at the
# tag of the installed version (`git checkout v$(python -c 'import deepspeed;print(deepspeed.__version__)')`).
# PYTEST_ARGS narrow the run (default: all of tests/unit/checkpoint), e.g. `-k "load_module_only"`.
# Environment: PYTHONPATH (kept: e.g. a folder holding pytest<8.4, which DeepSpeed's tests need),
# PYTHON (default .venv/bin/python), OUT (default deepspeed_suite_out/), JOBS_TIMEOUT
# (seconds a distributed test may take, default 300), NVCOMP_SUITE_SECTION (the section added,
# default {"enabled": true, "algorithm": "zstd"}).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/.." && pwd)
src=${1:?usage: bash scripts/deepspeed_suite.sh DEEPSPEED_SOURCE_DIR [PYTEST_ARGS...]}
shift
src=$(cd "$src" && pwd)
[ -d "$src/tests/unit/checkpoint" ] || { echo "$src has no tests/unit/checkpoint: give a git clone of DeepSpeed" >&2; exit 2; }
py=${PYTHON:-$repo/.venv/bin/python}
out=${OUT:-$repo/deepspeed_suite_out}
mkdir -p "$out"
[ $# -gt 0 ] || set -- tests/unit/checkpoint

installed=$("$py" -c 'import deepspeed; print(deepspeed.__version__)' 2>/dev/null | tail -n 1)
checkout=$(cat "$src/version.txt" 2>/dev/null || echo unknown)
echo "DeepSpeed installed: $installed; tests from: $src (version.txt: $checkout)"
[ "$installed" = "$checkout" ] || echo "note: the tests' version differs from the installed DeepSpeed; differences may come from that" >&2
# DeepSpeed's harness wants pytest<8.4 (its requirements-dev.txt): with a newer pytest its
# class-based fixtures (the elastic and universal data-parallel tests) are not found.
"$py" -c 'import sys, pytest; sys.exit(tuple(map(int, pytest.__version__.split(".")[:2])) >= (8, 4))' || \
  echo "note: pytest $("$py" -c 'import pytest; print(pytest.__version__)') is newer than DeepSpeed's tests support (<8.4); some of their fixtures error at setup. Put an older one first: pip install --target DIR 'pytest<8.4' and PYTHONPATH=DIR" >&2

# DeepSpeed's CPU accelerator counts "devices" from LOCAL_SIZE: 4 lets the 4-rank tests run.
export DS_ACCELERATOR=cpu LOCAL_SIZE=${LOCAL_SIZE:-4} DS_UNITTEST_TIMEOUT=${JOBS_TIMEOUT:-300}
run() {  # run NAME [extra PYTHONPATH]
  local name=$1 extra=${2:-} path
  path=$extra
  [ -z "${PYTHONPATH:-}" ] || path=${path:+$path:}$PYTHONPATH
  echo "== $name run: $(date -u +%H:%M:%S)"
  (cd "$src/tests" && PYTHONPATH="$path" "$py" -m pytest -q -p no:cacheprovider \
      --junitxml="$out/$name.xml" -o junit_family=xunit1 "${@:3}") > "$out/$name.log" 2>&1 || true
  tail -n 1 "$out/$name.log"
}
rel=()
for a in "$@"; do rel+=("${a#tests/}"); done
run deepspeed "" "${rel[@]}"
run nvcomp "$here/deepspeed_suite" "${rel[@]}"
"$py" "$here/deepspeed_suite/compare.py" "$out/deepspeed.xml" "$out/nvcomp.xml"
