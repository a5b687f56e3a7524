"""bench/RESULTS.md and the README's status section are generated from the committed
runs (``python -m bench report --readme``), and a run older than the code is flagged."""

import copy
import datetime
import json
import subprocess

import pytest

from bench import __main__ as cli
from bench import pages, provenance, readme_tables, report


def test_committed_pages_are_what_the_command_writes():
    """Fails when bench/RESULTS.md or the README's status section was edited by hand or
    a committed run changed without regenerating them."""
    stale = pages.stale_pages(pages.pages())
    assert not stale, (f"{', '.join(map(str, stale))} differ from what "
                       "`python -m bench report --readme` writes: run it and commit the result")


def test_check_flag_writes_nothing_and_says_what_differs(tmp_path, monkeypatch, capsys):
    readme = tmp_path / "README.md"
    results_md = tmp_path / "RESULTS.md"
    readme.write_text(f"# x\n\n{pages.STATUS_BEGIN}\nstale placeholder\n{pages.STATUS_END}\n\n"
                      f"{readme_tables.PATHS_BEGIN}\n{readme_tables.PATHS_END}\n"
                      f"{readme_tables.SETTINGS_BEGIN}\n{readme_tables.SETTINGS_END}\nafter\n")
    real = pages.pages
    monkeypatch.setattr(pages, "pages", lambda: real(readme=readme, results_md_path=results_md))
    assert cli.main(["report", "--readme", "--check"]) == 1
    assert f"{results_md} differs" in capsys.readouterr().err and not results_md.exists()
    assert cli.main(["report", "--readme"]) == 0
    text = readme.read_text()
    assert text.startswith("# x\n\n" + pages.STATUS_BEGIN) and text.endswith(
        readme_tables.SETTINGS_END + "\nafter\n")
    assert "stale placeholder" not in text and "**Grouped GEMM, N-major weights**" in text
    assert readme_tables.paths_markdown() in text and readme_tables.settings_markdown() in text
    assert results_md.read_text() == pages.results_md()
    assert cli.main(["report", "--readme", "--check"]) == 0
    readme.write_text("# no markers\n")
    assert cli.main(["report", "--readme"]) == 2
    assert "no <!-- bench:status begin -->" in capsys.readouterr().err


def test_readme_check_refuses_a_run_or_paths(capsys):
    for argv in (["report", "--readme", "x.json"], ["report", "--check", "x.json"],
                 ["report"]):
        with pytest.raises(SystemExit) as exc:
            cli.main(argv)
        assert exc.value.code == 2


def _run(suite, device="NVIDIA H200", **extra):
    cases = [{"model": "m", "gemm": "down", "T": t, "routing": "uniform", "backend": b,
              "status": "ok", "ms": ms, "tflops": 1.0, "tbps": 1.0, "flops": 1e9, "bytes": 1e6}
             for t, b, ms in ((16, "ts_moe", 1.0), (16, "torch_grouped_mm", 1.5),
                              (4096, "ts_moe", 2.0), (4096, "torch_grouped_mm", 1.0))]
    report.add_ratios(cases)
    return {"suite": suite, "device": device, "date": "2026-12-24T10:00:00+00:00",
            "torch": "2.13.0", "cuda": "13.0", "roofs": None, "command": "python -m bench",
            "cases": cases, **extra}


def test_page_of_current_runs_and_others(tmp_path):
    prov = {"commit": "abcdef0123456789", "dirty": False, "host": "h", "gpu": "NVIDIA H200",
            "driver": "570", "torch": "2.13.0", "cuda": "13.0", "nvidia-cutlass-dsl": "4.8.1",
            "transformers": "5.0.0"}
    (tmp_path / "nvidia-h200-grouped_gemm.json").write_text(
        json.dumps(_run("grouped_gemm", provenance=prov)))
    (tmp_path / "nvidia-h200-other.json").write_text(json.dumps(_run("other")))
    (tmp_path / "nvidia-h200-grouped_gemm-ab.json").write_text(json.dumps(_run("grouped_gemm")))
    current, others = pages.load_runs(tmp_path)
    assert [p.name for p, _ in current] == ["nvidia-h200-grouped_gemm.json",
                                            "nvidia-h200-other.json"]
    assert [p.name for p, _ in others] == ["nvidia-h200-grouped_gemm-ab.json"]
    page = pages.results_md(tmp_path)
    assert page.count("\n## ") == 3  # two suites and the other runs
    assert "- run: 2026-12-24T10:00:00+00:00; commit abcdef012345, host h" in page
    assert "| model | T=16 | T=4096 |" in page
    assert "| m | 1.000 (1.50x) | 2.000 (0.50x) |" in page
    assert "`nvidia-h200-grouped_gemm-ab.json`" not in page  # listed by its path
    assert "grouped_gemm-ab.json`: grouped_gemm on NVIDIA H200" in page
    status = pages.status_markdown(tmp_path)
    lines = status.splitlines()
    assert lines[0] == pages.STATUS_BEGIN and lines[-1] == pages.STATUS_END
    gemm = next(line for line in lines if "Grouped GEMM" in line)
    assert "1.50x at T <= 128; 0.50x at T >= 4096" in gemm
    assert gemm.endswith("(NVIDIA H200, 2026-12-24, commit abcdef012345).")
    generic = next(line for line in lines if "**other**" in line)  # no summary of its own
    assert "peer: 0.50-1.50x over 2 cases (NVIDIA H200, 2026-12-24, provenance unknown)" in generic


def test_fp8_summary_judges_the_kernel_against_its_own_bf16_and_torch():
    cases = [{"model": "m", "gemm": "down", "T": t, "routing": "uniform", "step": recipe,
              "backend": b, "status": "ok", "ms": ms}
             for t, recipe, b, ms in ((1, "blockwise", "ts_moe_fp8", 1.0),
                                      (1, "blockwise", "ts_moe_bf16", 1.9),
                                      (4096, "rowwise", "ts_moe_fp8", 2.0),
                                      (4096, "rowwise", "ts_moe_bf16", 3.0),
                                      (4096, "rowwise", "torch_scaled_grouped_mm", 2.2))]
    text = pages.fp8_summary({"suite": "fp8", "cases": cases})
    assert "blockwise at decode 1.90x against `ts_moe_bf16`" in text
    assert "rowwise at T >= 4096 1.10x against `torch_scaled_grouped_mm`" in text
    assert "rowwise at decode" not in text  # no such case


def test_committed_page_is_short_and_covers_every_current_run():
    text = report.RESULTS_MD.read_text()
    assert len(text.splitlines()) < 400
    current, others = pages.load_runs()
    for path, result in current:
        assert f"## {pages.title(result)}" in text
        assert f"python -m bench report bench/results/{path.name}" in text
    for path, _ in others:
        assert f"`bench/results/{path.name}`" in text


def _git(repo, *args, when=None):
    env = {"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
           "GIT_COMMITTER_EMAIL": "t@t", "HOME": str(repo)}
    if when:
        env.update(GIT_AUTHOR_DATE=when, GIT_COMMITTER_DATE=when)
    out = subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True,
                         env=env, check=True)
    return out.stdout.strip()


@pytest.fixture
def repo(tmp_path):
    """A checkout whose kernels changed on 2026-12-20, and a README change after."""
    _git(tmp_path, "init", "-q")
    (tmp_path / "ts_moe").mkdir()
    (tmp_path / "ts_moe" / "moe.py").write_text("x = 1\n")
    _git(tmp_path, "add", ".")
    _git(tmp_path, "commit", "-qm", "moe", when="2026-12-20T12:00:00+00:00")
    (tmp_path / "README.md").write_text("r\n")
    _git(tmp_path, "add", ".")
    _git(tmp_path, "commit", "-qm", "readme", when="2026-12-22T12:00:00+00:00")
    return tmp_path


def test_staleness_by_commit_time(repo):
    head = _git(repo, "rev-parse", "HEAD")
    old = {"date": "2026-12-19T00:00:00+00:00"}  # no provenance: its date counts
    warning = provenance.staleness(old, repo)
    assert warning.startswith("warning: this run is older than the last change to "
                              "csrc_free_kernels or ts_moe")
    assert "its date 2026-12-19" in warning
    assert provenance.staleness({"date": "2026-12-21T00:00:00+00:00"}, repo) is None
    # a known commit's time wins over the run's date
    fresh = {"date": "2000-01-01T00:00:00+00:00", "provenance": {"commit": head}}
    assert provenance.staleness(fresh, repo) is None
    first = _git(repo, "rev-list", "--max-parents=0", "HEAD")
    assert provenance.staleness({**fresh, "provenance": {"commit": first}}, repo) is None
    (repo / "ts_moe" / "moe.py").write_text("x = 2\n")
    _git(repo, "commit", "-qam", "moe again", when="2026-12-23T12:00:00+00:00")
    assert f"its commit {head[:12]}" in provenance.staleness(fresh, repo)
    assert provenance.collect(None, repo)["dirty"] is False
    (repo / "README.md").write_text("changed\n")
    assert provenance.collect(None, repo)["dirty"] is True


def test_targets_warns_about_a_stale_run(tmp_path, capsys, monkeypatch):
    run = json.loads(next(report.RESULTS_DIR.glob("*-moe_block.json")).read_text())
    monkeypatch.setattr(provenance, "last_change", lambda repo=None: (
        "f" * 40, datetime.datetime(2030, 1, 1, tzinfo=datetime.timezone.utc)))
    path = tmp_path / "run.json"
    path.write_text(json.dumps(run))
    assert cli.main(["targets", str(path)]) == 0
    assert "older than the last change" in capsys.readouterr().err
    newer = copy.deepcopy(run)  # no commit known here: judged by its date
    newer["date"], newer["provenance"] = "2031-01-01T00:00:00+00:00", None
    path.write_text(json.dumps(newer))
    assert cli.main(["targets", str(path)]) == 0
    assert "older" not in capsys.readouterr().err


def test_the_path_tables_follow_the_family_status(monkeypatch):
    """The README's path and family tables are generated from the families' records: a
    family's new record (here: the sm_100a kernel verified on a B200) changes them."""
    import dataclasses

    from csrc_free_kernels.common.family import Proof, Run
    from csrc_free_kernels.sm100 import GEMM_SM100

    before = readme_tables.paths_markdown()
    assert "ts_moe's sm_100a kernel (**compiled and model-checked only**)" in before
    verified = dataclasses.replace(GEMM_SM100, proof=Proof.VERIFIED,
                                   run=Run("abcdef1", "NVIDIA B200", "2027-01-01", "ok"))
    monkeypatch.setattr(readme_tables, "GEMM_SM100", verified)
    monkeypatch.setattr(readme_tables, "FAMILIES", tuple(
        verified if f.name == "gemm_sm100" else f for f in readme_tables.FAMILIES))
    after = readme_tables.paths_markdown()
    assert "ts_moe's sm_100a kernel (**verified on hardware: NVIDIA B200, abcdef1**)" in after
    assert "| NVIDIA B200, abcdef1, 2027-01-01: ok |" in after
