"""Codec ratios and speeds on a reproducible reference training state.

Why a generated state: codec ratios on random tensors say nothing about checkpoints, and a
downloaded model is neither reproducible offline nor a *training* state (it has no Adam moments).
So the benchmark makes its own: a small GPT-style byte-level model trained for a few hundred steps
on the Python standard library's own source files, with bf16 autocast and fp32 AdamW, the recipe
DeepSpeed's bf16 mode stores. Each part of that state (bf16 weights, fp32 master weights,
exp_avg, exp_avg_sq) is one flat tensor, cut into chunks and coded with every codec, option and
transform the engine can choose, on the GPU (nvCOMP) and on the CPU (zstd, deflate). Every
round trip is checked bit-exact; speeds are medians of several calls.

    python -m benchmarks.bench_codecs --device cuda --size base --steps 300 --out runs/bench
    python -m benchmarks.bench_codecs --device cpu --size tiny --steps 30 --out runs/bench-cpu

Run from the repository root. Writes ``bench_codecs.json`` and ``bench_codecs.md`` into ``--out``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import math
import platform
import statistics
import sys
import sysconfig
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from nvcomp_ckpt_engine import selection
from nvcomp_ckpt_engine.codecs import Plan, candidates_for
from nvcomp_ckpt_engine.codecs.base import Codec, element_of
from nvcomp_ckpt_engine.codecs.cpu import DeflateCodec, ZstdCodec
from nvcomp_ckpt_engine.codecs.nvcomp_gpu import NvcompCodec, nvcomp_available, nvcomp_version
from nvcomp_ckpt_engine.transforms import from_planes, to_planes

logger = logging.getLogger("bench_codecs")

#: Model presets: width, depth, heads, sequence length, batch. "base" is GPT-2 small's shape
#: (~85M parameters); "tiny" trains in seconds on a CPU.
SIZES: dict[str, dict[str, int]] = {
    "tiny": {"width": 64, "layers": 2, "heads": 2, "seq": 128, "batch": 8},
    "small": {"width": 512, "layers": 8, "heads": 8, "seq": 512, "batch": 16},
    "base": {"width": 768, "layers": 12, "heads": 12, "seq": 512, "batch": 32},
}
VOCAB = 256
#: Seconds above which one warm-up call marks a measurement as slow (timed once, not `--reps`).
SLOW_S = 0.25


class Block(nn.Module):
    """Pre-norm transformer block: causal self-attention, then a 4x GELU MLP."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.fc, self.out = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d)
        x = x + self.proj(y)
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    """A byte-level GPT: token + position embeddings, blocks, final norm, untied output head."""

    def __init__(self, width: int, layers: int, heads: int, seq: int) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(VOCAB, width), nn.Embedding(seq, width)
        self.blocks = nn.ModuleList(Block(width, heads) for _ in range(layers))
        self.ln, self.head = nn.LayerNorm(width), nn.Linear(width, VOCAB, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


def stdlib_corpus() -> tuple[torch.Tensor, dict[str, Any]]:
    """The standard library's .py files, sorted by path and concatenated, as uint8 bytes.

    Real text that every Python installation has: no download. It differs between Python
    versions, so its size and hash go into the results.
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    blobs = []
    for path in sorted(root.rglob("*.py")):
        if "site-packages" in path.parts or "dist-packages" in path.parts:
            continue
        try:
            blobs.append(path.read_bytes())
        except OSError:
            continue
    data = b"".join(blobs)
    info = {
        "files": len(blobs),
        "bytes": len(data),
        "sha256": hashlib.sha256(data).hexdigest()[:16],
        "python": platform.python_version(),
    }
    return torch.frombuffer(bytearray(data), dtype=torch.uint8), info


def train(
    args: argparse.Namespace, device: torch.device
) -> tuple[nn.Module, torch.optim.AdamW, dict[str, Any]]:
    """Train the model `args.steps` steps with bf16 autocast and fp32 AdamW; return its state."""
    torch.manual_seed(args.seed)
    shape = SIZES[args.size]
    corpus, corpus_info = stdlib_corpus()
    corpus = corpus.to(device)
    model = GPT(shape["width"], shape["layers"], shape["heads"], shape["seq"]).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    g = torch.Generator(device=device).manual_seed(args.seed)
    window = torch.arange(shape["seq"] + 1, device=device)
    warmup = max(1, args.steps // 10)
    losses = []
    start = time.perf_counter()
    for step in range(args.steps):
        for group in opt.param_groups:
            progress = max(0.0, (step - warmup) / max(1, args.steps - warmup))
            cosine = 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))
            group["lr"] = args.lr * min((step + 1) / warmup, cosine)
        high = corpus.numel() - shape["seq"] - 1
        starts = torch.randint(0, high, (shape["batch"], 1), device=device, generator=g)
        tokens = corpus[starts + window].long()
        with torch.autocast(device.type, dtype=torch.bfloat16):
            logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.float().reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step % 50 == 0 or step == args.steps - 1:
            losses.append((step, round(loss.item(), 4)))
            logger.info("step %d loss %.4f", step, loss.item())
    info = {
        "params": sum(p.numel() for p in model.parameters()),
        "steps": args.steps,
        "train_seconds": round(time.perf_counter() - start, 1),
        "loss": losses,
        "corpus": corpus_info,
        **shape,
    }
    return model, opt, info


def state_parts(model: nn.Module, opt: torch.optim.AdamW) -> dict[str, torch.Tensor]:
    """The four parts of a bf16 + fp32-AdamW checkpoint, each one flat tensor."""
    params = list(model.parameters())
    master = torch.cat([p.detach().reshape(-1) for p in params])
    return {
        "w_bf16": master.to(torch.bfloat16),
        "master_fp32": master,
        "exp_avg": torch.cat([opt.state[p]["exp_avg"].reshape(-1) for p in params]),
        "exp_avg_sq": torch.cat([opt.state[p]["exp_avg_sq"].reshape(-1) for p in params]),
    }


def entropy_bound(u8: torch.Tensor, width: int) -> float:
    """Raw bits / sum of the order-0 entropies of the byte planes: an estimate, not a limit."""
    bits = 0.0
    for plane in u8.view(-1, width).t():
        p = torch.bincount(plane.contiguous(), minlength=256).double()
        p = p[p > 0] / plane.numel()
        bits += float(-(p * p.log2()).sum())
    return 8 * width / bits


@dataclass(frozen=True)
class Mode:
    """One way to code a part: a codec, whether byte planes go first, and where it runs.

    `make` None is the engine's own `algorithm="auto"` choice: the plan `selection.choose` picks
    for the part from its sample, so the table shows what a save stores for each part.
    """

    label: str
    make: Callable[[], Codec] | None
    planes: bool
    where: str
    chunk_bytes: int | None = None

    def plan(self, part: torch.Tensor, chunk_bytes: int) -> Plan:
        """The codec, byte-plane width and element hint this mode codes `part` with, in chunks
        of `chunk_bytes`."""
        if self.make is None:
            candidates = candidates_for(part.dtype, part.device, algorithm="auto", portable=self.where == "cpu")
            if self.where == "cpu":  # the choice of a machine without nvCOMP: the same plans, CPU zstd
                candidates = [Plan(ZstdCodec(), p.width, p.element) for p in candidates]
            return selection.choose(candidates, part.reshape(-1).view(torch.uint8), chunk_bytes=chunk_bytes)
        if self.planes:
            return Plan(self.make(), part.element_size(), "u1")
        return Plan(self.make(), 1, element_of(part.dtype))


def gpu_modes() -> list[Mode]:
    """Every nvCOMP codec and the options and transforms worth comparing."""
    def nv(name: str, **options: Any) -> Callable[[], Codec]:
        return lambda: NvcompCodec(name, **options)

    return [
        Mode("auto (the engine's choice per part)", None, False, "gpu"),
        Mode("ANS", nv("ans", data_types={}), False, "gpu"),
        Mode("ANS typed (<f2/<f4), 1 MiB", nv("ans"), False, "gpu"),
        Mode("ANS typed, 64 KiB", nv("ans", uncomp_chunk_size=1 << 16), False, "gpu"),
        Mode("ANS planes", nv("ans", data_types={}), True, "gpu"),
        Mode("Zstd (64 KiB frames)", nv("zstd", uncomp_chunk_size=1 << 16), False, "gpu"),
        Mode("Zstd planes (64 KiB frames)", nv("zstd", uncomp_chunk_size=1 << 16), True, "gpu"),
        Mode("Zstd (1 MiB frames)", nv("zstd", uncomp_chunk_size=1 << 20), False, "gpu"),
        # One RAW deflate stream per chunk runs nearly serially in nvCOMP 6.0: 1 MiB chunks here.
        Mode("Deflate (1 MiB chunks)", nv("deflate"), False, "gpu", 1 << 20),
        Mode("Deflate planes (1 MiB chunks)", nv("deflate"), True, "gpu", 1 << 20),
        Mode("GDeflate", nv("gdeflate"), False, "gpu"),
        Mode("GDeflate planes", nv("gdeflate"), True, "gpu"),
        Mode("Bitcomp", nv("bitcomp"), False, "gpu"),
        Mode("Cascaded", nv("cascaded"), False, "gpu"),
        Mode("LZ4", nv("lz4"), False, "gpu"),
        Mode("LZ4 planes", nv("lz4"), True, "gpu"),
    ]


def cpu_modes() -> list[Mode]:
    """The engine's CPU codecs (one core each), with and without byte planes."""
    modes = [Mode("auto, portable (cpu)", None, False, "cpu")]
    for label, make in (
        ("zstd-1", lambda: ZstdCodec(1)),
        ("zstd-3", lambda: ZstdCodec(3)),
        ("deflate-1", lambda: DeflateCodec(1)),
    ):
        modes.append(Mode(f"{label} (cpu)", make, False, "cpu"))
        modes.append(Mode(f"{label} planes (cpu)", make, True, "cpu"))
    return modes


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], Any], reps: int, device: torch.device) -> tuple[float, Any]:
    """Median wall time of `reps` calls of `fn` (after one warm-up call), and its last result.

    A call slower than `SLOW_S` in warm-up is timed once: a slow codec must not eat the run.
    """
    _sync(device)
    start = time.perf_counter()
    result = fn()
    _sync(device)
    if time.perf_counter() - start > SLOW_S:
        reps = 1
    times = []
    for _ in range(reps):
        _sync(device)
        start = time.perf_counter()
        result = fn()
        _sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times), result


def _chunks(u8: torch.Tensor, chunk_bytes: int) -> list[torch.Tensor]:
    return list(u8.split(chunk_bytes))


def measure(mode: Mode, part: torch.Tensor, chunk_bytes: int, reps: int) -> dict[str, Any]:
    """Ratio and encode/decode GB/s of `mode` on `part`; raises if the round trip is not exact."""
    device = part.device
    u8 = part.reshape(-1).view(torch.uint8)
    plan = mode.plan(part, chunk_bytes)
    codec, width, element = plan.codec, plan.width, plan.element

    def encode() -> list[torch.Tensor]:
        return codec.encode_batch(_chunks(to_planes(u8, width), chunk_bytes), element=element)

    restored = torch.empty_like(u8)
    staging = torch.empty_like(u8) if width > 1 else restored

    def decode() -> None:
        codec.decode_batch(payloads, _chunks(staging, chunk_bytes), element=element)
        if width > 1:
            from_planes(staging, width, restored)

    enc_s, payloads = timed(encode, reps, device)
    dec_s, _ = timed(decode, reps, device)
    if not torch.equal(restored, u8):
        raise RuntimeError(f"{mode.label}: round trip is not bit-exact")
    compressed = sum(p.numel() for p in payloads)
    return {
        "codec": codec.name,
        "planes": width > 1,
        "raw_bytes": u8.numel(),
        "comp_bytes": compressed,
        "ratio": u8.numel() / compressed,
        "encode_gbps": u8.numel() / enc_s / 1e9,
        "decode_gbps": u8.numel() / dec_s / 1e9,
        "exact": True,
    }


def cpu_sample(part: torch.Tensor, nbytes: int, pieces: int = 32) -> torch.Tensor:
    """`pieces` evenly spaced windows of `part` totalling about `nbytes`, on the CPU.

    The CPU codecs run near 0.05-1 GB/s per core, so they see a sample spread over the whole
    tensor (every layer, not just the first ones) rather than all of it.
    """
    flat = part.reshape(-1)
    per = max(1, nbytes // pieces // part.element_size())
    if per * pieces >= flat.numel():
        return flat.cpu()
    stride = flat.numel() // pieces
    return torch.cat([flat[i * stride : i * stride + per] for i in range(pieces)]).cpu()


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Train, then measure every mode on every part; returns the JSON-able results.

    The JSON file is rewritten after each mode, so a run cut short keeps what it measured.
    """
    device = torch.device(args.device)
    model, opt, model_info = train(args, device)
    parts = state_parts(model, opt)
    del model, opt
    use_gpu = device.type == "cuda" and nvcomp_available()
    modes = (gpu_modes() if use_gpu else []) + cpu_modes()
    if args.modes:
        wanted = [w.strip() for w in args.modes.split(",")]
        modes = [m for m in modes if any(m.label.startswith(w) for w in wanted)]
    results: list[dict[str, Any]] = []
    report = {
        "command": " ".join(["python -m benchmarks.bench_codecs", *sys.argv[1:]]),
        "device": (
            torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"
        ),
        "torch": torch.__version__,
        "nvcomp": nvcomp_version() if use_gpu else None,
        "chunk_bytes": args.chunk_mib << 20,
        "cpu_sample_bytes": args.cpu_mib << 20,
        "model": model_info,
        "parts": {
            name: {
                "dtype": str(p.dtype).removeprefix("torch."),
                "bytes": p.numel() * p.element_size(),
                "bound": entropy_bound(p.reshape(-1).view(torch.uint8), p.element_size()),
            }
            for name, p in parts.items()
        },
        "results": results,
    }
    for mode in modes:
        for name, part in parts.items():
            data = part if mode.where == "gpu" else cpu_sample(part, args.cpu_mib << 20)
            reps = args.reps if mode.where == "gpu" else args.cpu_reps
            row = {"mode": mode.label, "where": mode.where, "part": name}
            try:
                row.update(measure(mode, data, mode.chunk_bytes or args.chunk_mib << 20, reps))
                logger.info(
                    "%-28s %-12s %.3fx enc %.2f dec %.2f GB/s",
                    mode.label, name, row["ratio"], row["encode_gbps"], row["decode_gbps"],
                )
            except Exception as exc:  # noqa: BLE001 - record the failure in the table, measure the rest
                logger.exception("%s on %s failed", mode.label, name)
                row["error"] = f"{type(exc).__name__}: {exc}"
            results.append(row)
        (args.out / "bench_codecs.json").write_text(json.dumps(report, indent=1))
    return report


def markdown(report: dict[str, Any]) -> str:
    """The results as one table: a row per mode, a column per part, plus the whole state."""
    parts = list(report["parts"])
    rows: dict[str, dict[str, dict[str, Any]]] = {}
    for r in report["results"]:
        rows.setdefault(r["mode"], {})[r["part"]] = r
    m = report["model"]
    lines = [
        f"Device: {report['device']}; torch {report['torch']}; nvCOMP {report['nvcomp']}. "
        f"Model: {m['params'] / 1e6:.1f}M params ({m['layers']} layers x {m['width']}), {m['steps']} steps "
        f"on {m['corpus']['bytes'] / 1e6:.1f} MB of Python {m['corpus']['python']} stdlib source, "
        f"final loss {m['loss'][-1][1]}. Chunks of {report['chunk_bytes'] >> 20} MiB; CPU rows on a "
        f"{report['cpu_sample_bytes'] >> 20} MiB sample of each part, one core.",
        "",
        "Cells: ratio (encode / decode GB/s). `state` = whole 14 B/param state (raw / compressed bytes). "
        "`bound` = order-0 entropy of the byte planes.",
        "",
        "| mode | " + " | ".join(f"{p} ({report['parts'][p]['bytes'] / 1e6:.1f} MB)" for p in parts)
        + " | state |",
        "|---|" + "---|" * (len(parts) + 1),
        "| bound | " + " | ".join(f"{report['parts'][p]['bound']:.3f}" for p in parts) + " | |",
    ]
    for mode, cells in rows.items():
        ok = [c for c in cells.values() if "error" not in c]
        state = None
        if len(ok) == len(cells):
            state = sum(c["raw_bytes"] for c in ok) / sum(c["comp_bytes"] for c in ok)
        text = [_cell(cells[p]) if p in cells else "" for p in parts]
        lines.append(f"| {mode} | " + " | ".join(text) + f" | {'' if state is None else f'{state:.3f}'} |")
    return "\n".join(lines) + "\n"


def _cell(row: dict[str, Any]) -> str:
    """"ratio (enc/dec)" for a measurement, or its error."""
    if "error" in row:
        return "error: " + row["error"][:60].replace("|", "/")
    return f"{row['ratio']:.3f} ({_speed(row['encode_gbps'])}/{_speed(row['decode_gbps'])})"


def _speed(gbps: float) -> str:
    return f"{gbps:.0f}" if gbps >= 10 else f"{gbps:.2f}"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="cuda or cpu")
    p.add_argument("--out", type=Path, required=True, help="directory for bench_codecs.json / .md")
    p.add_argument("--steps", type=int, default=300, help="training steps before measuring")
    p.add_argument(
        "--size", choices=sorted(SIZES), default=None,
        help="model preset (default: base on cuda, tiny on cpu)",
    )
    p.add_argument("--chunk-mib", type=int, default=16, help="chunk size handed to the codecs")
    p.add_argument("--reps", type=int, default=5, help="timed calls per GPU measurement (median)")
    p.add_argument("--cpu-reps", type=int, default=3, help="timed calls per CPU measurement (median)")
    p.add_argument("--cpu-mib", type=int, default=16, help="MiB sample of each part the CPU codecs see")
    p.add_argument(
        "--modes", default=None,
        help="comma-separated prefixes of the mode labels to measure (default: every mode)",
    )
    p.add_argument("--lr", type=float, default=6e-4)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.size is None:
        args.size = "base" if args.device.startswith("cuda") else "tiny"
    return args


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    report = run(args)
    (args.out / "bench_codecs.md").write_text(markdown(report))
    logger.info("wrote %s", args.out / "bench_codecs.md")


if __name__ == "__main__":
    main()
