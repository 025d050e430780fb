"""The docs stay true to the code.

docs/config.md is exactly what tools/config_reference.py renders from the config
dataclasses' docstrings (and that tool refuses an undocumented field);
docs/reference/metrics.md and docs/reference/cli.md are what tools/metrics_reference.py
and tools/cli_reference.py render from the metrics collector and the CLI's parser. Every
job in docs/cookbook.md loads with `Job.from_dict`, and its strategy, shipped or defined
in the cookbook's Python blocks, plans steps on synthetic metadata through the real
Planner core, which checks that each selected sample is planned exactly once. The README
fits on a screen, its job (Python and YAML) builds, and every relative link in README.md
and docs/ reaches a file (and a heading, where it names one).
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import inspect
import re
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml

from overlord.config import Job
from overlord.plan.core import PlannerCore, resolve_strategy
from overlord.plan.meta import MetaChunk
from overlord.plan.schedule import Dynamic, from_config, mixing_unit
from overlord.plan.tree import ClientPlaceTree
from overlord.runtime.layout import Layout

ROOT = Path(__file__).resolve().parent.parent
COOKBOOK = ROOT / "docs" / "cookbook.md"
MODULE = "my_strategies"  # what the cookbook calls the module its Python blocks form


def _fenced(lang: str) -> list[str]:
    return re.findall(rf"^```{lang}\n(.*?)^```", COOKBOOK.read_text(), flags=re.M | re.S)


YAML_BLOCKS = _fenced("yaml")


README = ROOT / "README.md"
README_MAX_LINES = 260


def _load_tool(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "tools" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def tool():
    return _load_tool("config_reference")


# -- the config reference ----------------------------------------------------------------


def test_config_reference_is_current(tool, capsys):
    rc = tool.main(["--check"])
    assert rc == 0, capsys.readouterr().err  # stale: run python tools/config_reference.py


def test_config_reference_covers_every_field_of_every_config_class(tool):
    text = (ROOT / "docs" / "config.md").read_text()
    names = [c.__name__ for c in tool.config_classes()]
    assert names == ["Job", "Source", "Mesh", "BatchSpec", "Mixing", "Autoscale"]
    for cls in tool.config_classes():
        section = text.split(f"## `{cls.__name__}`", 1)[1].split("\n## ", 1)[0]
        rows = re.findall(r"^\| `(\w+)` \|", section, flags=re.M)
        assert rows == [f.name for f in dataclasses.fields(cls)]


def test_attributes_read_multiline_and_shared_entries(tool):
    @dataclasses.dataclass(frozen=True)
    class Demo:
        """Demo config.

        Attributes:
            size: how many,
                continued here.
            cert, key: a pair
                described once.

        Raises:
            Nothing: this section is not an attribute.
        """

        size: int = 1
        cert: str | None = None
        key: str | None = None

    summary, described = tool.attributes(Demo)
    assert summary == "Demo config."
    assert described == {
        "size": "how many, continued here.",
        "cert": "a pair described once.",
        "key": "a pair described once.",
    }


def test_an_undocumented_field_fails_loudly(tool, monkeypatch, capsys):
    @dataclasses.dataclass(frozen=True)
    class Partial:
        """Half documented.

        Attributes:
            known: documented.
        """

        known: int = 0
        forgotten: int = 0

    monkeypatch.setattr(tool, "config_classes", lambda: [Partial])
    with pytest.raises(tool.DocError, match=r"Partial\.forgotten"):
        tool.render()
    assert tool.main(["--check"]) == 2
    assert "Partial.forgotten" in capsys.readouterr().err

    @dataclasses.dataclass(frozen=True)
    class Stale:
        """Describes a field it lacks.

        Attributes:
            gone: no longer a field.
        """

    with pytest.raises(tool.DocError, match="'gone'"):
        tool.attributes(Stale)


# -- the metrics and CLI references ---------------------------------------------------------


@pytest.mark.parametrize("name", ["metrics_reference", "cli_reference"])
def test_generated_reference_is_current(name, capsys):
    rc = _load_tool(name).main(["--check"])
    assert rc == 0, capsys.readouterr().err  # stale: run python tools/<name>.py


def test_metrics_reference_lists_every_family_the_collector_yields():
    metrics = _load_tool("metrics_reference")
    names = [name for name, *_ in metrics.families()]
    assert len(names) == len(set(names)) >= 20
    text = (ROOT / "docs" / "reference" / "metrics.md").read_text()
    assert re.findall(r"^\| `(overlord_\w+)` \|", text, flags=re.M) == names
    assert "overlord_source_samples_total" in names and "overlord_up" in names  # counters keep _total


def test_cli_reference_has_every_subcommand_and_option():
    cli = _load_tool("cli_reference")
    text = (ROOT / "docs" / "reference" / "cli.md").read_text()
    subs = cli._subcommands(cli.parser())
    assert [name for name, _, _ in subs][:2] == ["sidecar", "check"]
    for name, _, sub in subs:
        section = text.split(f"## overlord {name}\n", 1)[1].split("\n## ", 1)[0]
        for action in sub._actions:
            for flag in action.option_strings:
                if flag not in ("-h", "--help"):
                    assert f"`{flag}" in section, (name, flag)


# -- the README and the links between the docs ----------------------------------------------


def _fenced_in(path: Path, lang: str) -> list[str]:
    return re.findall(rf"^```{lang}\n(.*?)^```", path.read_text(), flags=re.M | re.S)


def test_readme_fits_on_a_screen():
    lines = README.read_text().count("\n")
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines; move depth to docs/"


@pytest.mark.parametrize("page", ["README.md", "docs/getting-started.md"])
def test_the_first_job_builds_the_same_in_python_and_yaml(page, monkeypatch):
    monkeypatch.delenv("OVERLORD_NODE", raising=False)
    script = _fenced_in(ROOT / page, "python")[0]
    setup = script.split("\nloader = ", 1)[0]  # the imports and the job, before anything runs
    scope: dict = {}
    exec(compile(setup, page, "exec"), scope)  # noqa: S102 - the page's own snippet
    from_yaml = Job.from_dict(yaml.safe_load(_fenced_in(ROOT / page, "yaml")[0]))
    assert scope["job"] == from_yaml  # "the same job as YAML" is the same job


def _doc_files() -> list[Path]:
    return [README, *sorted((ROOT / "docs").rglob("*.md"))]


def _anchors(path: Path) -> set[str]:
    text = re.sub(r"^```.*?^```", "", path.read_text(), flags=re.M | re.S)
    return {_slug(h) for h in re.findall(r"^#+ (.+)$", text, flags=re.M)}


def test_every_relative_link_in_readme_and_docs_resolves():
    broken = []
    for doc in _doc_files():
        text = re.sub(r"^```.*?^```", "", doc.read_text(), flags=re.M | re.S)
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto:, ...
                continue
            path, _, anchor = target.partition("#")
            dest = (doc.parent / path).resolve() if path else doc
            where = f"{doc.relative_to(ROOT)} -> {target}"
            if not dest.exists():
                broken.append(f"{where}: no such file")
            elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
                broken.append(f"{where}: no heading with that anchor")
    assert not broken, "\n".join(broken)


def test_docs_pages_are_linked_from_the_readme_or_another_page():
    linked = set()
    for doc in _doc_files():
        for target in re.findall(r"\]\(([^)#\s]+)", doc.read_text()):
            linked.add((doc.parent / target).resolve())
    orphans = [str(p.relative_to(ROOT)) for p in _doc_files()[1:] if p.resolve() not in linked]
    assert not orphans, orphans


# -- the cookbook --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def cookbook(tmp_path_factory):
    """The cookbook's Python blocks, in order, as the module `my_strategies`."""
    where = tmp_path_factory.mktemp("cookbook")
    (where / f"{MODULE}.py").write_text("\n\n".join(_fenced("python")))
    sys.path.insert(0, str(where))
    try:
        yield importlib.import_module(MODULE)
    finally:
        sys.path.remove(str(where))
        sys.modules.pop(MODULE, None)


def _functions(module, *params: str) -> dict:
    return {
        name: fn
        for name, fn in vars(module).items()
        if inspect.isfunction(fn)
        and fn.__module__ == MODULE
        and tuple(inspect.signature(fn).parameters)[: len(params)] == params
    }


def _plan_steps(job: Job, strategy, steps: int = 3) -> list:
    """Plan `steps` steps of `job` with `strategy` on synthetic metadata (text sources get
    token counts up to the context length, image sources patches too)."""
    layout = Layout.plan(job)
    core = PlannerCore(
        streams=layout.streams,
        stream_source=layout.stream_source,
        tree=ClientPlaceTree(job.mesh),
        schedule=from_config(job.mixing, [s.name for s in job.sources], [s.weight for s in job.sources]),
        strategy=strategy,
        seed=job.seed,
        global_batch=job.batch.global_batch,
        micro_batches=job.batch.micro_batches,
        context_length=job.batch.context_length,
        finite=job.epochs is not None,
        drop_last=job.batch.drop_last,
        mixing_unit=mixing_unit(job.mixing),
    )
    rng = np.random.default_rng(7)
    n = (steps + 1) * job.batch.global_batch
    for i, src in enumerate(layout.stream_source):
        tokens = rng.integers(8, job.batch.context_length, n)
        patches = rng.integers(16, 785, n) if "image" in job.sources[src].transform else np.zeros(n, np.int64)
        core.add(i, MetaChunk(0, np.arange(n), tokens, patches, tokens * 4 + patches * 768))
    if isinstance(core.schedule, Dynamic):
        core.schedule.observe(0, {f"loss/{s.name}": 1.0 + k for k, s in enumerate(job.sources)})
        assert np.isfinite(core.schedule.current).all() and core.schedule.current.sum() > 0
    plans = []
    for _ in range(steps):
        plan = core.plan_step()  # raises PlanError unless every selected sample is planned once
        assert plan is not None, "enough metadata was reported; the step must plan"
        assert len(plan.buckets) == core.tree.buckets(plan.axis)
        assert all(len(bucket) == job.batch.micro_batches for bucket in plan.buckets)
        assert plan.samples() + plan.deferred == job.batch.global_batch
        plans.append(plan)
    return plans


def test_cookbook_has_six_to_ten_recipes_each_with_a_snippet():
    recipes = re.split(r"^## \d+\. ", COOKBOOK.read_text(), flags=re.M)[1:]
    assert 6 <= len(recipes) <= 10
    assert all("```yaml" in r or "```python" in r for r in recipes)


@pytest.mark.parametrize("index", range(len(YAML_BLOCKS)))
def test_cookbook_job_loads_and_plans(index, cookbook, monkeypatch):
    monkeypatch.delenv("OVERLORD_NODE", raising=False)
    job = Job.from_dict(yaml.safe_load(YAML_BLOCKS[index]))  # also resolves a dynamic mixing fn
    if job.autoscale is not None:
        from overlord.autoscale.apply import budget_of

        budget_of(job)  # its keys make a valid Budget
    plans = _plan_steps(job, resolve_strategy(job.strategy))
    if job.strategy.endswith(":cp_tp_broadcast"):
        assert plans[0].broadcast == ("TP",)
    if job.strategy.endswith(":vlm_encoder_world"):
        assert plans[0].encoder is not None and any(plans[0].encoder)


def test_cookbook_strategies_plan(cookbook):
    strategies = _functions(cookbook, "data", "tree")
    assert len(strategies) >= 4
    job = Job.from_dict(
        {
            "name": "cookbook",
            "sources": [
                {"name": "web", "paths": ["/x/*.parquet"]},
                {"name": "laion", "paths": ["/y/*.parquet"], "transform": "overlord.transforms:image_text"},
            ],
            "mesh": {"dp": 2, "cp": 2, "tp": 2},
            "batch": {"global_batch": 32, "micro_batches": 2, "context_length": 1024},
        }
    )
    for fn in strategies.values():
        _plan_steps(job, fn)


def test_cookbook_mixing_functions_and_trainer_helpers(cookbook):
    mixers = _functions(cookbook, "step", "metrics", "base", "sources")
    assert mixers
    base, sources = np.array([0.5, 0.3, 0.2]), ["web", "code", "math"]
    for fn in mixers.values():
        weights = np.asarray(fn(50, {"loss/web": 2.0, "loss/code": 1.0, "loss/math": 3.0}, base, sources))
        assert weights.shape == base.shape and (weights > 0).all()
        assert weights[2] / base[2] > weights[1] / base[1]  # the worse source gets more

    reported = []

    class Loader:
        def report_metrics(self, metrics):
            reported.append(metrics)

    cookbook.report_source_losses(Loader(), {"web": 2.5, "code": np.float32(1.5)})
    assert reported == [{"loss/web": 2.5, "loss/code": 1.5}]


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to '-'."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_cookbook_links_reach_their_recipes():
    text = COOKBOOK.read_text()
    anchors = {_slug(h) for h in re.findall(r"^#+ (.+)$", text, flags=re.M)}
    links = re.findall(r"\]\(#([^)]+)\)", text)
    assert links and set(links) <= anchors, sorted(set(links) - anchors)
