

# 3 -- no silent no-op options: an option that cannot act on the mesh is refused ------------------
@pytest.mark.parametrize("args, says", [
    (["--world-size", 4, "--slow-precision", "int8"], "low-bit slow tier (int8,int8) has nothing to act on"),
    (["--world-size", 2, "--hsdp"], "HSDP would be plain FSDP"),
    (["--world-size", 2, "--topology", "flat", "--bucket-bytes", 1000], "--bucket-bytes 1000 needs --topology two-tier"),
], ids=["slow-tier-1d", "hsdp-1d", "bucket-bytes-flat"])
def test_an_option_that_cannot_act_on_the_mesh_is_refused(tmp_path, args, says):
    proc = hpf_cmd("train", *args, "--steps", 1, "--out", tmp_path / "run")
    assert proc.returncode == 2 and says in one_error_line(proc)
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_the_library_refuses_a_slow_tier_on_a_mesh_without_one():
    params = gpt.init(gpt.CONFIGS["tiny"], device="meta")
    with pytest.raises(ValueError, match="nothing to act on.*A 1-D mesh is one fast tier"):
        hpf.ShardStep.__module__  # (the step's plan is the one hpf plan prints)
        from hpf.step import step_plan
        step_plan(params, hpf.Mesh({"dp": 4}), topology=hpf.Topology(slow_weights="int8", slow_grads="int8"))
    from hpf.step import step_plan
    assert step_plan(params, hpf.Mesh({"node": 2, "local": 2}), topology=hpf.Topology(slow_grads="int8")).slow_precision
