"""A build's scratch folder (its kept PTX and cubin, which the pre-flight reads) is a path
the DSL can be told about, whatever ``TMPDIR`` holds: a space or a double quote is quoted
in the options; a single quote or a newline, which the DSL's pass pipeline cannot carry,
sends the folder to /tmp; with no folder to fall back on, the error names TMPDIR."""

import tempfile

import pytest
import torch

from csrc_free_kernels.common import compile as kcompile
from csrc_free_kernels.common import scratch


@pytest.fixture
def memory_only(monkeypatch):
    """Compiles in this process, nothing read from or written to the disk cache."""
    from csrc_free_kernels.common import settings as ksettings

    monkeypatch.setattr(ksettings.settings, "disk_cache", False)
    monkeypatch.setattr(kcompile, "_memory", {})


@pytest.fixture
def folders(monkeypatch):
    """The scratch folders made, by path."""
    made, real = [], scratch.directory

    def recording(prefix):
        made.append(real(prefix))
        return made[-1]

    monkeypatch.setattr(scratch, "directory", recording)
    return made


@pytest.mark.parametrize("name, plain", [("a b", True), ('dq"x', False), ("q'uote", False),
                                         ("nl\nx", False), ("é", False)])
def test_a_build_compiles_whatever_tmpdir_holds(tmp_path, monkeypatch, memory_only, folders,
                                                name, plain):
    tmp = tmp_path / name
    tmp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))  # TMPDIR, as tempfile read it
    from csrc_free_kernels.hopper import swiglu_sm90_launch as s

    assert kcompile.get_compiled(s.build(torch.bfloat16, False)) is not None
    (folder,) = folders
    assert folder.name.startswith(f"{tmp}/" if plain else "/tmp/ts_moe_preflight_")


def test_without_a_plain_folder_the_error_names_tmpdir(tmp_path, monkeypatch):
    tmp = tmp_path / "it's"
    tmp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))
    monkeypatch.setattr(scratch, "FALLBACKS", ())
    with pytest.raises(RuntimeError, match=rf"the temporary directory {str(tmp)!r} \(TMPDIR\) "
                                           rf"holds characters the DSL cannot take"):
        scratch.root()


def test_the_folder_is_quoted_in_the_options():
    assert scratch.dump_options("/tmp/a b/x") == \
        " --keep-ptx --keep-cubin --dump-dir '/tmp/a b/x'"
