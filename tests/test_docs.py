"""The docs say what the code does, where that is cheap to check.

- README and docs/DEEPSPEED.md list the codecs `"portable": true` allows, which are
  `codecs.PORTABLE`;
- the chart of run E in docs/BENCHMARKS.md (also shown in README) plots the figures its table
  quotes;
- every file README links to or shows exists, the Hugging Face example among them.
"""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path
from types import ModuleType

import pytest

from nvcomp_ckpt_engine.codecs import PORTABLE

ROOT = Path(__file__).resolve().parents[1]


def _portable_row_codecs(doc: Path) -> tuple[str, ...]:
    """The codecs in parentheses in the `portable` row of a doc's configuration table."""
    (row,) = [line for line in doc.read_text().splitlines() if line.startswith("| `portable` |")]
    match = re.search(r"only codecs a CPU can decode \(([^)]*)\)", row)
    assert match, row
    return tuple(name.strip() for name in match[1].split(","))


@pytest.mark.parametrize("doc", ["README.md", "docs/DEEPSPEED.md"])
def test_the_portable_codecs_are_the_ones_the_code_allows(doc: str) -> None:
    assert _portable_row_codecs(ROOT / doc) == PORTABLE


def _plot_module() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "plot_deepspeed", ROOT / "benchmarks" / "plot_deepspeed.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _leading_seconds(cell: str) -> float:
    """The first figure of a table cell such as "**10.8 s** (10.7, 10.9): **1.87x**"."""
    match = re.search(r"(\d+(?:\.\d+)?) s\b", cell)
    assert match, cell
    return float(match[1])


@pytest.mark.parametrize("run, results", [("E", "bench_deepspeed_h200_load.json"),
                                          ("H", "bench_deepspeed_h200_scaleout.json")])
def test_the_charts_plot_the_figures_of_their_tables(run: str, results: str) -> None:
    """Runs E and H: the bars of benchmarks/plot_deepspeed.py are the table's blocked, durable
    and load figures, variant by variant (to the table's precision)."""
    plot = _plot_module()
    report = json.loads((ROOT / "docs/results" / results).read_text())
    rows = [line.split("|")[1:-1] for line in (ROOT / "docs/BENCHMARKS.md").read_text()
            .splitlines() if line.startswith(f"| {run} |")]
    assert len(rows) == len(report["results"])
    for row, result in zip(rows, report["results"]):
        quoted = [_leading_seconds(row[i]) for i in (3, 4, 5)]
        plotted = plot.bar_values(result)
        for figure, bar in zip(quoted, plotted):
            decimals = len(str(figure).split(".")[1])
            assert round(bar, decimals) == figure, (result["variant"], quoted, plotted)


@pytest.mark.parametrize("png", sorted((ROOT / "docs/results").glob("*.png")), ids=lambda p: p.name)
def test_each_committed_chart_was_drawn_from_the_json_beside_it(png: Path) -> None:
    """A chart carries the SHA-256 of the result it was drawn from (plot_deepspeed.py): a result
    re-measured without re-drawing its chart fails here."""
    plot = _plot_module()
    result = png.with_suffix(".json")
    assert result.is_file(), f"{png.name} has no {result.name} beside it"
    assert plot.source_of(png) == plot.digest(result.read_bytes()), (
        f"{png.name} was not drawn from {result.name}: python benchmarks/plot_deepspeed.py "
        f"docs/results/{result.name} docs/results/{png.name}")


def test_the_files_readme_points_at_exist() -> None:
    text = (ROOT / "README.md").read_text()
    targets = re.findall(r"\]\(([^)#:]+)\)", text)
    assert "docs/results/bench_deepspeed_h200_scaleout.png" in targets
    assert "examples/hf_trainer/" in targets
    for target in targets:
        assert (ROOT / target).exists(), target
    example = (ROOT / "examples/hf_trainer/train.py").read_text()
    assert 'deepspeed="ds_config.json"' in text and "deepspeed=str(DS_CONFIG)" in example
    config = json.loads((ROOT / "examples/hf_trainer/ds_config.json").read_text())
    assert config["nvcomp_checkpoint"] == {"enabled": True}


def _module_rows() -> list[tuple[list[str], str]]:
    """docs/ARCHITECTURE.md's "Every module" table: (the modules a row is about, its job)."""
    text = (ROOT / "docs/ARCHITECTURE.md").read_text().split("## Every module", 1)[1]
    table = text.split("\n## ", 1)[0]
    rows = [line.split("|")[1:-1] for line in table.splitlines() if line.startswith("| `")]
    return [(re.findall(r"`([^`]+)`", first), job) for first, job in rows]


def test_every_file_the_module_table_names_exists_and_every_module_is_named() -> None:
    """Each file a row names lies where the row says (in its package, or at the top), and each
    module of the package is named in some row: the map cannot point at a file that is gone."""
    package = ROOT / "nvcomp_ckpt_engine"
    named: set[Path] = set()
    for modules, job in _module_rows():
        for module in modules:
            path = package / module
            assert path.exists(), f"docs/ARCHITECTURE.md names {module}, which does not exist"
            named.add(path)
            if module.endswith("/"):
                for file in re.findall(r"`([\w/]+\.py)`", job):
                    assert (path / file).exists(), f"docs/ARCHITECTURE.md: {module}{file} does not exist"
                    named.add(path / file)
    for module in package.rglob("*.py"):
        if module.name in ("__init__.py", "__main__.py") or module.parent.name == "demo":
            continue
        assert module in named, (
            f"docs/ARCHITECTURE.md's module table does not name {module.relative_to(package)}")
