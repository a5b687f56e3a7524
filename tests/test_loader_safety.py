"""load_mixtral_experts on hostile or careless checkpoints: sizes checked against the
router's header before any per-expert key is made, shards only regular files inside
the checkpoint directory, every error naming the file and the field."""

import json
import shutil

import pytest
import torch

import ts_moe
from ts_moe import loaders

from .helpers import FifoWatch

INDEX = "model.safetensors.index.json"
EXPERT_KEY = "model.layers.0.block_sparse_moe.experts.{}.w1.weight"


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """A sharded v4 checkpoint (4 experts, 2 layers) and its weights as loaded."""
    path = ts_moe.make_tiny_moe_checkpoint(tmp_path_factory.mktemp("src") / "ckpt", layers=2,
                                           experts=4, shards=3)
    return path, ts_moe.load_mixtral_experts(path, device="cpu")


@pytest.fixture
def ckpt(source, tmp_path):
    """A fresh copy of the source checkpoint to spoil."""
    return shutil.copytree(source[0], tmp_path / "ckpt")


def _edit_json(path, edit):
    value = json.loads(path.read_text())
    edit(value)
    path.write_text(json.dumps(value))


@pytest.fixture
def no_expert_lists(monkeypatch):
    """Fail at once where a layer's per-expert keys would be made for more experts than
    the checkpoint holds (the old path built 3 * 10**7 strings, 10.7 GiB, first)."""
    real = loaders._layer_plan

    def guarded(*args):
        assert all(isinstance(a, bool) or not isinstance(a, int) or a < 64 for a in args[1:]), \
            f"per-expert keys made for {args}"
        return real(*args)

    monkeypatch.setattr(loaders, "_layer_plan", guarded)


@pytest.mark.parametrize("drop_config", [False, True])
def test_a_huge_expert_index_key_is_named_before_any_expert_list(ckpt, no_expert_lists,
                                                                 drop_config):
    index = ckpt / INDEX
    big = EXPERT_KEY.format(1_000_000)
    _edit_json(index, lambda v: v["weight_map"].__setitem__(
        big, v["weight_map"][EXPERT_KEY.format(0)]))
    if drop_config:
        (ckpt / "config.json").unlink()
    with pytest.raises(ValueError, match=rf"{INDEX}.*{big}.*expert 1000000.*4 experts"):
        ts_moe.load_mixtral_experts(ckpt, device="cpu")


@pytest.mark.parametrize("value", [10**7, 5, 0, -1, True, 4.0, "4", None])
def test_a_bad_num_local_experts_is_named_before_any_expert_list(ckpt, no_expert_lists, value):
    _edit_json(ckpt / "config.json", lambda c: c.__setitem__("num_local_experts", value))
    with pytest.raises(ValueError, match=r"config\.json: num_local_experts"):
        ts_moe.load_mixtral_experts(ckpt, device="cpu")


@pytest.mark.parametrize("field", ["hidden_size", "intermediate_size"])
@pytest.mark.parametrize("value", [0, "64", 64.0, None])
def test_bad_config_sizes_are_named(ckpt, field, value):
    _edit_json(ckpt / "config.json", lambda c: c.__setitem__(field, value))
    with pytest.raises(ValueError, match=rf"config\.json: {field} must be a positive int"):
        ts_moe.load_mixtral_experts(ckpt, device="cpu")


def test_the_router_header_decides_the_expert_count(ckpt, source):
    """Without config.json the experts are the router's rows: the loader still reads
    the same weights."""
    (ckpt / "config.json").unlink()
    got = ts_moe.load_mixtral_experts(ckpt, device="cpu")
    for layer, weights in source[1].items():
        for name, t in weights.items():
            assert torch.equal(got[layer][name], t)


def _shard_of(index_path, key=EXPERT_KEY.format(0)):
    return json.loads(index_path.read_text())["weight_map"][key]


def _point_shard(ckpt, name):
    """Point every key of the first expert's shard at ``name``."""
    index = ckpt / INDEX
    old = _shard_of(index)
    _edit_json(index, lambda v: v["weight_map"].update(
        {k: name for k, s in v["weight_map"].items() if s == old}))
    return old


def test_shard_names_outside_the_directory_are_refused(ckpt, tmp_path):
    outside = tmp_path / "x.safetensors"  # a valid shard: the old loader read it
    shutil.copy(ckpt / _shard_of(ckpt / INDEX), outside)
    for name in ("../x.safetensors", str(outside), "sub/../../x.safetensors"):
        _point_shard(ckpt, name)
        with pytest.raises(ValueError, match=rf"{INDEX}: weight_map\[.*{name}.*not a file "
                                             rf"inside the checkpoint directory"):
            ts_moe.load_mixtral_experts(ckpt, device="cpu")


def test_a_link_out_of_the_directory_is_refused(ckpt, tmp_path):
    outside = tmp_path / "x.safetensors"
    shutil.copy(ckpt / _shard_of(ckpt / INDEX), outside)
    (ckpt / "link.safetensors").symlink_to(outside)
    _point_shard(ckpt, "link.safetensors")
    with pytest.raises(ValueError, match=rf"{INDEX}: weight_map\[.*link\.safetensors.*"
                                         rf"outside the checkpoint directory"):
        ts_moe.load_mixtral_experts(ckpt, device="cpu")


def test_links_inside_the_directory_and_a_hub_cache_snapshot_load(source, tmp_path):
    """The Hugging Face cache: ``snapshots/<rev>/<file>`` link to ``../../blobs/<sha>``."""
    repo = tmp_path / "models--org--tiny"
    snapshot, blobs = repo / "snapshots" / "abc123", repo / "blobs"
    snapshot.mkdir(parents=True)
    blobs.mkdir()
    for i, f in enumerate(sorted(source[0].iterdir())):
        shutil.copy(f, blobs / f"blob{i}")
        (snapshot / f.name).symlink_to(f"../../blobs/blob{i}")
    got = ts_moe.load_mixtral_experts(snapshot, device="cpu")
    for layer, weights in source[1].items():
        for name, t in weights.items():
            assert torch.equal(got[layer][name], t)
    # a directory named "snapshots" elsewhere grants nothing beyond its repository's blobs
    (snapshot / "extra.safetensors").symlink_to(tmp_path / "nowhere.safetensors")
    shutil.copy(blobs / "blob1", tmp_path / "nowhere.safetensors")
    _point_shard(snapshot, "extra.safetensors")
    with pytest.raises(ValueError, match="outside the checkpoint directory"):
        ts_moe.load_mixtral_experts(snapshot, device="cpu")


@pytest.mark.parametrize("what", ["shard", "config.json", "model.safetensors"])
def test_a_fifo_is_refused_without_being_opened(ckpt, what):
    if what == "shard":
        name = "fifo.safetensors"
        _point_shard(ckpt, name)
        match = rf"{INDEX}: weight_map\[.*fifo\.safetensors.*not a regular file"
    elif what == "config.json":
        name = "config.json"
        (ckpt / name).unlink()
        match = r"config\.json.*not a regular file"
    else:  # a single-file checkpoint whose file is a FIFO
        (ckpt / INDEX).unlink()
        name = "model.safetensors"
        match = r"model\.safetensors.*not a regular file"
    fifo = FifoWatch(ckpt / name)
    try:
        with pytest.raises(ValueError, match=match):
            ts_moe.load_mixtral_experts(ckpt, device="cpu")
    finally:
        fifo.close()
    assert not fifo.opened


@pytest.mark.parametrize("weight_map", [None, ["model.safetensors"], {"k": 3}, {"k": ""}])
def test_a_malformed_index_is_named(ckpt, weight_map):
    _edit_json(ckpt / INDEX, lambda v: v.__setitem__("weight_map", weight_map))
    with pytest.raises(ValueError, match=rf"{INDEX}: weight_map"):
        ts_moe.load_mixtral_experts(ckpt, device="cpu")


@pytest.mark.parametrize("name", [INDEX, "config.json"])
def test_a_json_file_that_is_not_an_object_is_named(ckpt, name):
    for text in ("{", "[1]"):
        (ckpt / name).write_text(text)
        with pytest.raises(ValueError, match=rf"{name}: (not valid JSON|expected a JSON object)"):
            ts_moe.load_mixtral_experts(ckpt, device="cpu")


def test_a_missing_shard_names_the_index_entry(ckpt):
    _point_shard(ckpt, "gone.safetensors")
    with pytest.raises(FileNotFoundError, match=rf"{INDEX}: weight_map\[.*gone\.safetensors"):
        ts_moe.load_mixtral_experts(ckpt, device="cpu")


def test_a_nul_in_a_shard_name_is_named(ckpt):
    _point_shard(ckpt, "model\0.safetensors")
    with pytest.raises(ValueError, match=rf"{INDEX}: weight_map\[.*\] must map a key to a file "
                                         rf"name, got 'model\\x00\.safetensors'"):
        ts_moe.load_mixtral_experts(ckpt, device="cpu")


def test_layers_may_be_numpy_integers(ckpt, source):
    np = pytest.importorskip("numpy")
    got = ts_moe.load_mixtral_experts(ckpt, layers=np.int64(1), device="cpu")
    assert list(got) == [1] and type(next(iter(got))) is int
    assert torch.equal(got[1]["down_proj"], source[1][1]["down_proj"])
    assert list(ts_moe.load_mixtral_experts(ckpt, layers=[np.int32(0)], device="cpu")) == [0]
    for bad, what in ((1.0, "got float 1.0"), ("0", "got str '0'"), ([True], "got bool True")):
        with pytest.raises(TypeError, match=rf"^layers must .*{what}"):
            ts_moe.load_mixtral_experts(ckpt, layers=bad, device="cpu")


def test_the_plan_stops_at_the_first_key_the_index_lacks(tmp_path, monkeypatch):
    """A hostile index naming one key per expert of a router of many rows, the
    others missing: refused at the first missing key, before a key of the other
    experts is made (a 62 MiB index of this kind cost 5.9 s and 0.9 GB when the whole
    plan was built first)."""
    from safetensors.torch import save_file

    experts = 5000
    router = "model.layers.0.block_sparse_moe.gate.weight"
    tmp_path.joinpath("ckpt").mkdir()
    ckpt = tmp_path / "ckpt"
    save_file({router: torch.zeros(experts, 8, dtype=torch.bfloat16)}, ckpt / "a.safetensors")
    weight_map = {router: "a.safetensors"} | {EXPERT_KEY.format(e): "a.safetensors"
                                              for e in range(experts)}
    (ckpt / INDEX).write_text(json.dumps({"weight_map": weight_map}))
    made = []
    real = loaders.Bf16Format.expert_keys
    monkeypatch.setattr(loaders.Bf16Format, "expert_keys",
                        staticmethod(lambda base: made.append(base) or real(base)))
    missing = "model.layers.0.block_sparse_moe.experts.0.w3.weight"
    with pytest.raises(KeyError, match=rf"key '{missing}' is missing from {ckpt / INDEX}"):
        ts_moe.load_mixtral_experts(ckpt, device="cpu")
    assert len(made) <= 3, f"keys of {len(made)} linears made before the refusal"


def test_top_k_beyond_the_router_names_config_json(ckpt):
    """Without an expert count in config.json, the router's rows are the first
    count top-k meets."""
    def edit(config):
        del config["num_local_experts"]
        config["num_experts_per_tok"] = 5

    _edit_json(ckpt / "config.json", edit)
    with pytest.raises(ValueError, match=rf"{ckpt / 'config.json'}: num_experts_per_tok = 5 "
                                         rf"exceeds the router's 4 experts"):
        ts_moe.MoE.from_pretrained(ckpt, 0, device="cpu")
