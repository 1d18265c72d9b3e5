"""``hpf eval``, ``hpf export`` and ``hpf generate``: a trained checkpoint, used in this process.

Each takes a run folder (its newest checkpoint) or a checkpoint folder. The model and its config
come from the checkpoint (``hpf train`` stores them in every one), else from the run's run.json."""
from __future__ import annotations

from pathlib import Path

from hpf.cli.common import CliError
from hpf.jobspec import defaults, positive

__all__ = ["cmd_eval", "cmd_export", "cmd_generate", "add_eval_parser", "add_export_parser", "add_generate_parser",
           "load"]


def load(source: Path):
    """(checkpoint path, model module, config, params) of a run folder or checkpoint folder."""
    from hpf import checkpoint
    from hpf.cli import run_folder
    from hpf.models import MODELS, model_config, spec_of

    if (source / "checkpoints").is_dir() or (source / run_folder.RUN_FILE).is_file():
        ckpt = checkpoint.latest(source / "checkpoints")
        if ckpt is None:
            raise CliError(f"{source} is a run folder with no checkpoint; train with --save-every N (or --timeout), "
                           "or pass a checkpoint folder")
    else:
        ckpt = source
    try:
        meta = checkpoint.meta(ckpt)
    except checkpoint.CheckpointError as e:
        raise CliError(str(e) if str(ckpt) in str(e) else f"{source}: {e}") from None  # (named once)
    if "model" in meta and "config" in meta:
        module = MODELS[meta["model"]]
        config = type(next(iter(spec_of(module).configs.values())))(**meta["config"])
    else:  # a checkpoint of an older hpf train: its run folder says
        run = run_folder.read_run(ckpt.resolve().parent.parent)
        options = (run or {}).get("options")
        if not options:
            raise CliError(f"{ckpt} does not say which model it holds (no model in its header, no run.json two "
                           "folders up); load it with hpf.checkpoint.load_params in Python")
        vocab = run.get("vocab_size")
        module, config = model_config(options["model"], options["config"], vocab)
    return ckpt, module, config, checkpoint.load_params(ckpt)


def eval_settings(args, ckpt: Path) -> tuple[dict, str]:
    """hpf eval's data, batch size, batches and seed: each given, else the run's own held-out
    evaluation's (its run.json, two folders above the checkpoint), so the loss is the run's
    eval_loss of that checkpoint; else hpf train's defaults. Also where they came from, in words."""
    from hpf.cli import job, run_folder

    run = run_folder.read_run(ckpt.resolve().parent.parent)
    ran = {**defaults("train"), **(run or {}), "batches": job.EVAL_BATCHES}
    given = [k for k in ("data", "batch_size", "batches", "seed") if getattr(args, k) is not None]
    settings = {k: getattr(args, k) if k in given else ran[k] for k in ("data", "batch_size", "batches", "seed")}
    if settings["data"] is None:
        raise CliError(f"{ckpt}: its run names no token folder (the synthetic source, or no run.json two folders "
                       "up); pass --data DIR")
    source = ("the run's held-out settings" if run else "hpf train's defaults (no run.json two folders up)") + \
        "".join(f", --{k.replace('_', '-')} as given" for k in given)
    return settings, source


def cmd_eval(args) -> int:
    import torch

    from hpf import data as token_data
    from hpf.models import spec_of

    ckpt, module, config, params = load(args.source)
    s, source = eval_settings(args, ckpt)
    try:
        meta = token_data.read_meta(s["data"])
    except (OSError, ValueError) as e:
        raise CliError(f"--data: {e}") from None
    if int(meta["vocab_size"]) != config.vocab_size:
        raise CliError(f"--data {s['data']} has a vocab of {meta['vocab_size']}, the model of {ckpt} one of "
                       f"{config.vocab_size}: evaluate on the data it was trained on")
    batches = token_data.TokenData(s["data"], "val").batches(s["batch_size"], config.seq_len, s["seed"],
                                                             state={"seed": s["seed"], "step": 0}, rank=0, world_size=1)
    loss_fn = spec_of(module).loss(config)
    with torch.no_grad():
        losses = [float(loss_fn(params, next(batches))) for _ in range(s["batches"])]
    print(f"eval: held-out loss {sum(losses) / len(losses):.4f} ({s['batches']} batches of {s['batch_size']} x "
          f"{config.seq_len} tokens, seed {s['seed']}, from {s['data']}'s val split: {source}; {ckpt})")
    return 0


def cmd_export(args) -> int:
    from hpf.models import llama

    ckpt, module, config, params = load(args.source)
    if module is not llama:
        raise CliError(f"--to hf writes transformers' LlamaForCausalLM: {ckpt} holds a {module.__name__.rsplit('.', 1)[1]} "
                       "model, which has no transformers counterpart; load it with hpf.checkpoint.load_params")
    llama.to_hf(config, params, args.dir)
    print(f"exported {ckpt} to {args.dir} (transformers' LlamaForCausalLM: config.json, model.safetensors)")
    return 0


def cmd_generate(args) -> int:
    import torch

    from hpf.models import spec_of

    ckpt, module, config, params = load(args.source)
    if spec_of(module).forward is None:
        raise CliError(f"{ckpt} holds a {spec_of(module).name} model, whose routing has no plain "
                       "forward here; hpf generate runs gpt and llama")
    if args.prompt_ids:
        ids = [int(x) for x in args.prompt_ids.split(",")]
    else:
        from hpf.data import BYTE_VOCAB
        if config.vocab_size != BYTE_VOCAB:
            raise CliError(f"--prompt TEXT needs a model of bytes (vocab {BYTE_VOCAB}, hpf prepare's default); this "
                           f"one has a vocab of {config.vocab_size}: pass --prompt-ids 1,2,3")
        ids = list(args.prompt.encode())
    if not ids or not all(0 <= i < config.vocab_size for i in ids):
        raise CliError(f"the prompt must be token ids in [0, {config.vocab_size})")
    kw = {"n_heads": config.n_heads} if "n_heads" in spec_of(module).forward.__kwdefaults__ else {"config": config}
    tokens = torch.tensor([ids])
    with torch.no_grad():
        for _ in range(args.tokens):  # greedy, over the last seq_len tokens
            logits = spec_of(module).forward(params, tokens[:, -config.seq_len:], **kw)
            tokens = torch.cat([tokens, logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    every = tokens[0].tolist()  # the prompt, then its continuation, as other generate commands show them
    if args.prompt_ids:
        print(",".join(map(str, every)))
    else:
        print(bytes(t for t in every if t < 256).decode(errors="replace"))
    return 0


def _source(parser) -> None:
    parser.add_argument("source", type=Path, metavar="RUN_OR_CHECKPOINT",
                        help="a run folder of hpf train (its newest checkpoint) or a checkpoint folder")


def add_eval_parser(sub, help_: str):
    p = sub.add_parser("eval", help=help_, description="The held-out loss of a checkpoint on a token folder's val "
                                                       "split, in this process (no ranks), with the run's own "
                                                       "evaluation settings unless given: the run's eval_loss of "
                                                       "that step.")
    _source(p)
    run = "(default: the run's, from its run.json, as its held-out loss used"
    p.add_argument("--data", type=Path, metavar="DIR", help=f"a token folder from hpf prepare {run})")
    p.add_argument("--batches", type=positive(int), metavar="N", help=f"held-out batches {run}: 4)")
    p.add_argument("--batch-size", type=positive(int), metavar="B", help=f"sequences a batch {run}: --batch-size)")
    p.add_argument("--seed", type=positive(int, least=0), metavar="S",
                   help=f"which held-out windows are drawn {run}: --seed)")
    p.set_defaults(run=cmd_eval)
    return p


def add_export_parser(sub, help_: str):
    p = sub.add_parser("export", help=help_, description="Write a checkpoint's model in another library's format: "
                                                         "--to hf, transformers' LlamaForCausalLM (--model llama).")
    _source(p)
    p.add_argument("--to", choices=("hf",), required=True, help="the format: hf (transformers)")
    p.add_argument("dir", type=Path, metavar="DIR", help="the folder to write")
    p.set_defaults(run=cmd_export)
    return p


def add_generate_parser(sub, help_: str):
    p = sub.add_parser("generate", help=help_, description="Greedy text from a checkpoint of gpt or llama, in this "
                                                           "process: prints the prompt followed by the tokens it "
                                                           "generates.")
    _source(p)
    prompt = p.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", metavar="TEXT", help="text, for a model of bytes (hpf prepare's default)")
    prompt.add_argument("--prompt-ids", metavar="IDS", help="token ids, comma-separated (any vocab)")
    p.add_argument("--tokens", type=positive(int), default=32, metavar="N", help="tokens to generate (default: 32)")
    p.set_defaults(run=cmd_generate)
    return p
