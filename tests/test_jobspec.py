"""hpf.jobspec is the one declaration of a job's options: the flags of hpf train, plan and
simulate, TrainJob, the search's candidates and the simulator's and memory model's inputs are
derived from it, and the library's own defaults for the same options agree with it."""
from __future__ import annotations

import argparse
import dataclasses
import inspect

import pytest

from hpf import jobspec, memory, search
from hpf.cli import build_parser
from hpf.cli.job import TrainJob
from hpf.config import StepConfig
from hpf.jobspec import JobSpec
from hpf.sim import predict


def _actions(command: str) -> dict[str, argparse.Action]:
    sub = next(a for a in build_parser(command)._actions if a.dest == "command").choices[command]
    return {a.dest: a for a in sub._actions}


@pytest.mark.parametrize("command", ["train", "plan", "simulate"])
def test_each_option_is_a_flag_of_its_commands_with_the_declared_default(command):
    actions = _actions(command)
    declared = jobspec.defaults(command)
    assert declared and set(declared) <= set(actions), set(declared) - set(actions)
    own = {"batch_size": None} if command == "plan" else {}  # hpf plan's: one sequence per rank
    for name, default in declared.items():
        action = actions[name]
        assert action.option_strings == ["--" + name.replace("_", "-")]
        # hpf train's flags default to None: a resumed run must tell a given flag from a default
        assert action.default == (None if command == "train" else own.get(name, default)), name
        if isinstance(default, bool):
            assert isinstance(action, argparse._StoreTrueAction), name
    if command == "train":
        assert build_parser("train").parse_args(["train"]).fresh == {"mesh": None, **declared}
    else:  # the train-only options are not flags here
        assert not set(jobspec.defaults("train")) - set(declared) & set(actions)


def test_a_flag_parses_as_declared():
    args = build_parser("plan").parse_args(["plan", "--bucket-bytes", "4096", "--slow-precision", "int8",
                                            "--fsdp-axes", "local", "--hsdp"])
    assert (args.bucket_bytes, args.slow_precision, args.fsdp_axes, args.hsdp) == (4096, "int8,int8", ("local",), True)
    with pytest.raises(SystemExit):
        build_parser("plan").parse_args(["plan", "--bucket-bytes", "-1"])


def test_train_job_is_the_spec_plus_what_the_driver_settles():
    spec = {f.name for f in dataclasses.fields(JobSpec)}
    job = {f.name for f in dataclasses.fields(TrainJob)}
    assert spec < job
    assert job - spec == {"axes", "metrics_path", "vocab_size", "resume", "trace_dir", "tensorboard", "stop_at"}


def test_the_search_dimensions_are_options_with_their_defaults():
    defaults = jobspec.defaults("train")
    for f in dataclasses.fields(search.Candidate):
        if f.name != "tp":  # (the mesh's, not a flag)
            assert f.name in defaults and f.default == defaults[f.name], f.name
    with pytest.raises(TypeError, match="no JobSpec option"):
        jobspec.searched("bucket_size")


def _keyword_defaults(fn) -> dict:
    return {k: p.default for k, p in inspect.signature(fn).parameters.items() if p.default is not p.empty}


@pytest.mark.parametrize("feeds, fn", [("sim", predict._inputs), ("memory", memory.predict)])
def test_the_simulator_and_memory_model_take_the_options_they_are_fed_with_the_same_defaults(feeds, fn):
    fed = jobspec.inputs(JobSpec(), feeds)
    assert fed and fed == {k: v for k, v in _keyword_defaults(fn).items() if k in fed}, (fed, _keyword_defaults(fn))
    assert set(fed) <= set(_keyword_defaults(fn))


def test_inputs_read_a_job_and_default_what_it_lacks():
    candidate = search.Candidate(recompute="all", accumulate=2)
    assert jobspec.inputs(candidate, "memory") == {"mixed_precision": None, "topology": "two-tier",
                                                   "recompute": "all", "accumulate": 2}
    assert jobspec.inputs(argparse.Namespace(topology="flat"), "memory")["topology"] == "flat"


def test_shard_step_takes_the_options_it_is_fed_with_the_same_defaults():
    """(``topology`` is an object there, None the flat ring: hpf.jobspec.step_topology makes it.)"""
    step = {f.name: f.default for f in dataclasses.fields(StepConfig)}
    fed = jobspec.inputs(JobSpec(), "step")
    assert set(fed) == {"mixed_precision", "hsdp", "accumulate", "mode"}
    assert fed == {k: step[k] for k in fed}
    assert search.Candidate(accumulate=2).step_args("gpt", search.model_config("gpt", "tiny")[1],
                                                     search.mesh_for({"dp": 2}))["accumulate"] == 2


def test_the_step_topology_of_a_job_refuses_what_the_flat_ring_lacks():
    two = jobspec.step_topology(search.Candidate(bucket_bytes=4096, slow_precision="int8,int4"))
    assert two.bucket_bytes == 4096 and two.slow_precision.text() == "int8,int4"
    assert jobspec.step_topology(search.Candidate(topology="flat")) is None
    for bad in (dict(bucket_bytes=4096), dict(slow_precision="int8")):
        with pytest.raises(ValueError, match="needs --topology two-tier"):
            jobspec.step_topology(search.Candidate(topology="flat", **bad))


def test_the_mode_names_are_the_step_classes_modes():
    from hpf.config import MODES
    from hpf.modes import STEPS

    mode = next(f for f in dataclasses.fields(JobSpec) if f.name == "mode")
    assert MODES == tuple(STEPS) == mode.metadata["flag"]["choices"]
