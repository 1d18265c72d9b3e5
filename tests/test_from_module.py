"""`hpf.from_module`: a torch module trained as plain torch trains it, each block read when it
runs; a loss that ignores its params is an error."""
import json

import pytest
import torch

import hpf
from cli_helpers import REPO, hpf_cmd


V, D = 23, 12


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.norm, self.up, self.down = torch.nn.LayerNorm(D), torch.nn.Linear(D, 3 * D), torch.nn.Linear(3 * D, D)

    def forward(self, h):
        return h + self.down(torch.nn.functional.gelu(self.up(self.norm(h))))


class Net(torch.nn.Module):
    def __init__(self, tied=False):
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(V, D)
        self.blocks = torch.nn.ModuleList([Block() for _ in range(3)])
        self.norm = torch.nn.LayerNorm(D)
        self.head = torch.nn.Linear(D, V, bias=False)
        if tied:
            self.head.weight = self.embed.weight

    def forward(self, x):
        h = self.embed(x)
        for b in self.blocks:
            h = b(h)
        return self.head(self.norm(h))


def lm(model, batch):
    return torch.nn.functional.cross_entropy(model(batch[:, :-1]).flatten(0, 1), batch[:, 1:].flatten())


def tokens(step, rank=0, world=1):
    full = torch.randint(0, V, (8, 9), generator=torch.Generator().manual_seed(step))
    return full.chunk(world)[rank]


def test_a_loss_that_ignores_its_params_is_an_error_at_the_first_step():
    model = Net()
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    step = hpf.shard_step(lambda p, b: lm(model, b), mesh=hpf.Mesh({"dp": 1}), optimizer=hpf.optim.adamw())
    with pytest.raises(hpf.UnusedParamsError, match="reached none of the params.*nn.Module.*hpf.from_module"):
        step(step.init(params), tokens(0))


ADAMW = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)


def _train_module(rank, tied):
    model = Net(tied)
    params, loss_fn = hpf.from_module(model, lm)
    step = hpf.shard_step(loss_fn, mesh=hpf.Mesh({"dp": 2}), optimizer=hpf.optim.adamw(**ADAMW))
    state = step.init(params)
    losses = []
    for s in range(4):
        state, m = step(state, tokens(s, rank, 2))
        losses.append(m["loss"])
    before = {n: p.clone() for n, p in model.state_dict().items()}
    hpf.to_module(model, step.full_params(state))
    return losses, len(step.plan.units), {n: p for n, p in model.state_dict().items()}, before


@pytest.mark.slow
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_from_module_trains_a_module_as_plain_torch_does(tied):
    from hpf.launcher import launch
    runs = launch(_train_module, 2, tied, timeout=120)
    model = Net(tied)
    assert all(torch.equal(runs[0][3][n], p) for n, p in model.state_dict().items()), "the loss changed the model"
    opt = torch.optim.AdamW(model.parameters(), **ADAMW)
    want = []
    for s in range(4):
        loss = lm(model, tokens(s))
        opt.zero_grad()
        loss.backward()
        opt.step()
        want.append(loss.item())
    losses, units, trained, _ = runs[0]
    assert units == 4  # the three blocks and the root
    torch.testing.assert_close(losses, want, rtol=1e-5, atol=0)
    for n, p in model.state_dict().items():  # fp32 AdamW over 4 steps: ~1e-7 apart
        torch.testing.assert_close(trained[n], p, rtol=0, atol=1e-5, msg=n)


def test_from_module_reads_each_block_when_it_runs_and_refuses_a_block_weight_read_outside_it():
    model = Net()
    params, loss_fn = hpf.from_module(model, lm)
    assert list(params) == ["embed", "blocks", "norm", "head"] and len(params["blocks"]) == 3
    assert set(params["blocks"][0]) == {"norm", "up", "down"}
    reads = []

    class Lazy(list):
        def __getitem__(self, i):
            reads.append(i)
            return super().__getitem__(i)
    loss_fn({**params, "blocks": Lazy(params["blocks"])}, tokens(0))
    assert reads == [0, 1, 2]
    outside = lambda m, b: m.blocks[0].up.weight.sum() + lm(m, b)  # noqa: E731
    _, bad = hpf.from_module(model, outside)
    with pytest.raises((RuntimeError, NotImplementedError), match="meta"):
        bad(params, tokens(0)).item()


@pytest.mark.slow
def test_the_module_page_example_runs(tmp_path):
    import re
    code = re.findall(r"```python\n(.*?)```", (REPO / "docs" / "modules.md").read_text(), flags=re.S)[1]
    (tmp_path / "ex.py").write_text(code)
    proc = hpf_cmd(code=f"import runpy; runpy.run_path({str(tmp_path / 'ex.py')!r}, run_name='__main__')")
    assert proc.returncode == 0, proc.stderr
    first, second = json.loads(proc.stdout.strip().splitlines()[-1])
    assert first == second < 2.0  # trained from ln(32) = 3.47, the same on both ranks
