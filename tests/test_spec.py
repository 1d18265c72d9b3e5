"""Specs, rules, meshes and trees: semantics and the errors users see for bad input."""
import pytest
import torch
import torch.distributed as dist

import hpf
from hpf import P


def params():
    return {"embed": torch.zeros(10, 4), "blocks": [{"w_q": torch.zeros(4, 4), "norm": torch.zeros(4)}],
            "scale": torch.zeros(())}


def test_p_equality_hash_repr():
    assert P("a", None) == P("a", None)
    assert P(("a", "b")) != P("a", "b")
    assert P(["a"]) == P("a")  # a one-axis tuple is the axis
    assert len({P("a"), P("a"), P()}) == 2
    assert repr(P(("node", "local"), None)) == "P(('node', 'local'), None)"
    assert P(("node", "local"), "tp").axes() == ("node", "local", "tp")
    with pytest.raises(hpf.SpecError, match="not None, an axis name"):
        P(3)


def test_rules_first_match_wins():
    r = hpf.rules([(r"blocks/\d+/w_\w+", P("dp")), (r"blocks/.*", P()), (r".*", P(None, "dp"))])
    assert r("blocks/0/w_q") == P("dp")
    assert r("blocks/0/norm") == P()
    assert r("embed") == P(None, "dp")


def test_tree_paths_and_map():
    paths, leaves, _ = hpf.tree.flatten(params())
    assert paths == ["blocks/0/norm", "blocks/0/w_q", "embed", "scale"]
    doubled = hpf.tree.map_with_path(lambda p, x: p, params())
    assert doubled["blocks"][0]["w_q"] == "blocks/0/w_q"


@pytest.mark.parametrize("spec,needle", [
    (P("nope"), "not a mesh axis"),
    (P("dp", "dp"), "twice"),
])
def test_bad_axis_names_path_and_fix(spec, needle):
    r = hpf.rules([(r"blocks/0/w_q", spec), (r".*", P())])
    with pytest.raises(hpf.SpecError) as e:
        hpf.plan(params(), hpf.Mesh({"dp": 2}), r)
    assert "blocks/0/w_q" in str(e.value) and needle in str(e.value)


def test_spec_with_too_many_entries():
    r = hpf.rules([(r"blocks/0/norm", P("dp", None)), (r".*", P())])
    with pytest.raises(hpf.SpecError) as e:
        hpf.plan(params(), hpf.Mesh({"dp": 2}), r)
    msg = str(e.value)
    assert "blocks/0/norm" in msg and "1 dims" in msg and "drop entries" in msg


def test_rules_without_match_name_path_and_fix():
    with pytest.raises(hpf.SpecError) as e:
        hpf.plan(params(), hpf.Mesh({"dp": 2}), hpf.rules([(r"blocks/.*", P())]))
    assert "'embed'" in str(e.value) and "catch-all" in str(e.value)


def test_spec_tree_with_other_structure():
    specs = {"embed": P(), "blocks": [{"w_q": P("dp")}], "scale": P()}  # norm missing
    with pytest.raises(hpf.SpecError) as e:
        hpf.plan(params(), hpf.Mesh({"dp": 2}), specs)
    assert "blocks/0/norm" in str(e.value) and "same dict keys" in str(e.value)


def test_spec_tree_with_same_structure_works():
    specs = {"embed": P("dp"), "blocks": [{"w_q": P(None, "dp"), "norm": None}], "scale": P()}
    plan = hpf.plan(params(), hpf.Mesh({"dp": 2}), specs)
    assert plan.specs["blocks/0/norm"] == P() and plan.specs["blocks/0/w_q"] == P(None, "dp")


def test_non_tensor_leaf():
    bad = params()
    bad["blocks"][0]["lr"] = 0.1
    with pytest.raises(TypeError) as e:
        hpf.plan(bad, hpf.Mesh({"dp": 2}))
    assert "blocks/0/lr" in str(e.value) and "torch.as_tensor" in str(e.value)


def test_non_fsdp_axis_must_divide():
    r = hpf.rules([(r"embed", P("tp")), (r".*", P())])
    with pytest.raises(hpf.SpecError) as e:
        hpf.plan(params(), hpf.Mesh({"dp": 1, "tp": 3}), r, fsdp_axes=("dp",))
    assert "embed" in str(e.value) and "divisible by 3" in str(e.value)


def test_mesh_geometry():
    m = hpf.Mesh({"node": 2, "local": 3})
    assert m.size == 6 and m.fast_axes == ("local",) and m.slow_axes == ("node",)
    assert [m.coords(r) for r in (0, 4)] == [(0, 0), (1, 1)]
    assert all(m.rank_of(m.coords(r)) == r for r in range(6))
    assert m.group_ranks("local", 4) == [3, 4, 5]
    assert m.group_ranks("node", 4) == [1, 4]
    assert m.all_groups("node") == [[0, 3], [1, 4], [2, 5]]
    assert m.group_index(("local", "node"), 4) == 4  # mesh order: node-major, (1, 1) -> 1*3+1
    with pytest.raises(hpf.MeshError, match="not an axis"):
        m.group_ranks("x", 0)
    with pytest.raises(hpf.MeshError, match="positive"):
        hpf.Mesh({"dp": 0})


def test_mesh_size_must_match_world(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        with pytest.raises(hpf.MeshError) as e:
            hpf.Mesh({"dp": 4}).group("dp")
        assert "4 ranks" in str(e.value) and "world_size=4" in str(e.value)
        step = hpf.shard_step(lambda p, b: p["w"].sum(), mesh=hpf.Mesh({"dp": 2}), optimizer=hpf.optim.adamw())
        with pytest.raises(hpf.MeshError, match="has 2 ranks but the process group has 1"):
            step.init({"w": torch.ones(3)})
    finally:
        dist.destroy_process_group()
