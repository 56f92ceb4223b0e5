"""Compare the loss log of an interrupted-and-resumed job with an uninterrupted reference run.

Both logs are the JSON lines the demo's rank 0 writes (`--loss-log`): one
`{"step", "loss", "start_step"}` object per step. The job's log holds every attempt in order, so a
step recomputed after a resume appears twice; each appearance must equal the reference exactly,
the job must cover every step of the reference, and at least one attempt must have resumed.
Exact means the same float: the whole point is that resuming changes nothing, so no tolerance.

A job relaunched on another number of ranks (``--ranks-changed``) adds its gradients in
another order, so its losses after the resume differ from the reference in the last bits: they
are shown side by side, and what must be identical is the state it resumed from. ``--states
DIR`` (the demo's ``--state-dir``) compares, bit for bit, every parameter's fp32 master and
Adam moments right after each resume with those written at that step's save.

Usage: python -m nvcomp_ckpt_engine.demo.compare REFERENCE.jsonl JOB.jsonl [--states DIR]
       [--ranks-changed]
Exit status 0 if identical, 1 if not.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class LossRecord:
    """One line of a loss log: the mean loss over all ranks after `step`, in an attempt that
    started (fresh or resumed) at `start_step`."""

    step: int
    loss: float
    start_step: int


def read_loss_log(path: Path) -> list[LossRecord]:
    """Parse a loss log; a missing file or a malformed line raises with the file named."""
    records = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        try:
            obj = json.loads(line)
            records.append(LossRecord(int(obj["step"]), float(obj["loss"]), int(obj["start_step"])))
        except (ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"{path}:{number}: not a loss record ({exc}): {line!r}") from exc
    return records


def compare(reference: list[LossRecord], job: list[LossRecord]) -> list[str]:
    """Return the differences between the two logs, one sentence each; empty means identical."""
    ref: dict[int, float] = {}
    for r in reference:
        if r.step in ref:
            return [
                f"the reference log has step {r.step} twice: "
                "it must come from one uninterrupted run"
            ]
        ref[r.step] = r.loss
    problems = [
        f"step {r.step} (attempt from step {r.start_step}): "
        f"loss {r.loss!r}, reference {ref.get(r.step)!r}"
        for r in job
        if ref.get(r.step) != r.loss
    ]
    missing = sorted(set(ref) - {r.step for r in job})
    if missing:
        problems.append(f"the job never logged steps {missing}")
    if not any(r.start_step for r in job):
        problems.append("the job log shows no resumed attempt, so it proves nothing about resuming")
    return problems


def _same_bits(a: object, b: object) -> bool:
    import torch

    return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype
            and a.shape == b.shape
            and torch.equal(a.contiguous().view(-1).view(torch.uint8),
                            b.contiguous().view(-1).view(torch.uint8)))


def compare_states(state_dir: Path) -> tuple[list[str], list[int]]:
    """The differences between each state written right after a resume and the one written at
    that step's save, one sentence each, and the steps compared."""
    import torch

    problems, steps = [], []
    for resumed_path in sorted(state_dir.glob("step*_resumed.pt")):
        step = int(resumed_path.name.removeprefix("step").split("_")[0])
        saved_path = state_dir / f"step{step}_saved.pt"
        if not saved_path.is_file():
            problems.append(f"{resumed_path}: no state written at the save of step {step}")
            continue
        saved = torch.load(saved_path, weights_only=True)
        resumed = torch.load(resumed_path, weights_only=True)
        for name in sorted(set(saved) | set(resumed)):
            for key in ("fp32", "exp_avg", "exp_avg_sq"):
                if not _same_bits(saved.get(name, {}).get(key), resumed.get(name, {}).get(key)):
                    problems.append(f"step {step}: {name} {key} after the resume is not the saved one")
        steps.append(step)
    if not steps and not problems:
        problems.append(f"{state_dir} holds no state written after a resume")
    return problems, steps


def format_table(reference: list[LossRecord], job: list[LossRecord]) -> str:
    """Both loss sequences side by side, one line per logged value of the job."""
    ref = {r.step: r.loss for r in reference}
    lines = [f"{'step':>5}  {'reference':>20}  {'job':>20}  {'attempt':<11}  same"]
    for r in job:
        attempt = "fresh" if r.start_step == 0 else f"resumed@{r.start_step}"
        same = "yes" if ref.get(r.step) == r.loss else "NO"
        ref_text = f"{ref[r.step]:.17g}" if r.step in ref else "-"
        lines.append(f"{r.step:>5}  {ref_text:>20}  {r.loss:>20.17g}  {attempt:<11}  {same}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Print both sequences and the verdict; exit 1 if they differ in any way."""
    p = argparse.ArgumentParser(
        prog="python -m nvcomp_ckpt_engine.demo.compare", description=__doc__.split("\n")[0]
    )
    p.add_argument("reference", type=Path, help="loss log of the uninterrupted run")
    p.add_argument(
        "job", type=Path, help="loss log of the interrupted and resumed job (all attempts)"
    )
    p.add_argument("--states", type=Path, help="the job's --state-dir: compare the resumed state")
    p.add_argument("--ranks-changed", action="store_true",
                   help="the job resumed on another number of ranks: its losses may differ in "
                   "the last bits, and are shown, not required equal")
    args = p.parse_args(argv)
    reference, job = read_loss_log(args.reference), read_loss_log(args.job)
    print(format_table(reference, job))
    resumes = sorted({r.start_step for r in job if r.start_step})
    failed = False
    if args.states is not None:
        state_problems, steps = compare_states(args.states)
        if state_problems:
            print("RESUMED STATE DIFFERS:\n  " + "\n  ".join(state_problems))
            failed = True
        else:
            print(f"RESUMED STATE IDENTICAL: every parameter's fp32 master and Adam moments "
                  f"after the resume at step(s) {steps} equal the saved ones bit for bit")
    problems = compare(reference, job)
    if args.ranks_changed:
        unequal = [p for p in problems if p.startswith("step ")]
        problems = [p for p in problems if not p.startswith("step ")]
        if not problems:
            print(f"LOSSES BESIDE THE REFERENCE: {len(reference)} steps, resumed at step(s) "
                  f"{resumes} on another number of ranks; {len(job) - len(unequal)} of "
                  f"{len(job)} logged losses equal bit for bit (the ranks add in another order)")
    if problems:
        print("LOSSES DIFFER:\n  " + "\n  ".join(problems))
        return 1
    if failed:
        return 1
    if not args.ranks_changed:
        print(f"IDENTICAL: {len(reference)} steps, resumed at step(s) {resumes}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
