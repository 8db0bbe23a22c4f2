"""Every benchmark script is reachable from ``bench/run_all.py``: each bench/*.py with a
top-level ``main`` has full and quick sizes there (or is named as no benchmark), so that
``python -m bench.run_all`` cannot silently leave one behind again. No database, no run."""

from __future__ import annotations

import ast

import pytest

from bench import common, run_all

BENCH = common.ROOT / "bench"


def _scripts_with_main() -> set[str]:
    names = set()
    for path in BENCH.glob("*.py"):
        tree = ast.parse(path.read_text(), filename=str(path))
        if any(isinstance(node, ast.FunctionDef) and node.name == "main" for node in tree.body):
            names.add(path.stem)
    return names


def test_every_script_with_a_main_is_run_by_run_all() -> None:
    scripts = _scripts_with_main()
    assert "loop" in scripts  # the scan sees the scripts
    missing = scripts - set(run_all.FULL) - set(run_all.NOT_BENCHES)
    assert not missing, f"bench scripts with a main that run_all does not run: {sorted(missing)}"


def test_full_and_quick_name_the_same_existing_scripts() -> None:
    assert list(run_all.FULL) == list(run_all.QUICK)
    for name in run_all.FULL:
        assert (BENCH / f"{name}.py").is_file(), name
    assert not set(run_all.FULL) & set(run_all.NOT_BENCHES)
    assert set(run_all.REQUIRES) <= set(run_all.FULL)


def test_only_accepts_every_name_and_help_lists_them(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit) as exc:
        run_all.main(["--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    for name in run_all.FULL:
        assert name in out, name
    with pytest.raises(SystemExit) as exc:
        run_all.main(["--only", "no_such_bench"])
    assert exc.value.code == 2
