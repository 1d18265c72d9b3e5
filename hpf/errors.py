"""Every public exception hpf raises, in one place (the validation mode's layout errors, which
name an op, are in hpf.validate.errors). Each message names the parameter path, rank or file
and says what to do; the modules that raise them import them from here."""
from __future__ import annotations

import signal

__all__ = ["MeshError", "SpecError", "SpecTreeError", "IndivisibleSpecError", "DonatedStateError",
           "ParamsMismatchError", "StaleParamError", "CapturedTensorError", "UnevenBatchError",
           "UnusedParamsError", "NonFiniteError", "ScheduleMismatchError", "PeerTimeoutError",
           "StoreValueError", "CheckpointError", "RankError", "Terminated", "NoFeasiblePlan", "PeerLostError",
           "UnrecoverableLossError"]


# -- the call: mesh, specs, params, batches ------------------------------------------------------------
class MeshError(ValueError):
    """A mesh that does not fit the run or the request; the message says what to change."""


class SpecError(ValueError):
    """A spec, rule or mesh that cannot describe the parameters; the message names the path."""


class SpecTreeError(SpecError):
    """A pytree of specs that does not have the params' structure."""


class IndivisibleSpecError(SpecError):
    """A non-FSDP axis that does not divide the dim it splits (only FSDP axes are padded)."""


class ParamsMismatchError(ValueError):
    """Ranks were given different params (paths, shapes, dtypes or values) at ``init``."""


class UnevenBatchError(ValueError):
    """Local batches of different shapes on different ranks: a mean of per-rank means is not the global mean."""


class UnusedParamsError(ValueError):
    """The loss reached none of the params it was given: nothing would train."""


class NoFeasiblePlan(ValueError):
    """Every candidate plan needs more memory per rank than the cap."""


# -- the step ------------------------------------------------------------------------------------------
class DonatedStateError(RuntimeError):
    """A train state already passed to ``step`` (its buffers were donated) was used again."""


class StaleParamError(RuntimeError):
    """loss_fn used a param tensor kept from an earlier step or micro-batch: its grads would be wrong."""


class CapturedTensorError(RuntimeError):
    """A block rematerialized under grad="torch.func" computed with a tensor that needs grad but
    is not one of its inputs (a closure, a global): its grad would be lost."""


class NonFiniteError(FloatingPointError):
    """A non-finite loss or grad norm, found before any update (the state stays finite); under
    fp16, ``LossScale.max_skipped`` overflowed steps in a row."""


# -- the ranks -----------------------------------------------------------------------------------------
class ScheduleMismatchError(RuntimeError):
    """Ranks issued different collectives: the loss function read different units on
    different ranks, or one rank skipped a collective call (a save, ``full_params``) the
    others made. Raised on every rank, before any update; the job cannot go on."""


class PeerTimeoutError(TimeoutError):
    """A wait outlasted the timeout; ``missing``: the ranks that were not waiting alongside (the
    ones to blame: hpf.launch names them)."""

    def __init__(self, message: str, missing: list[int]):
        super().__init__(message)
        self.missing = missing


class PeerLostError(RuntimeError):
    """A peer's heartbeat stopped (``hpf.elastic``): it died or its machine was lost. ``lost`` holds
    the ids of the ranks that went silent; an elastic job re-forms without them."""

    def __init__(self, message: str, lost: list[int]):
        super().__init__(message)
        self.lost = lost


class UnrecoverableLossError(RuntimeError):
    """An elastic job lost what it cannot rebuild: a rank together with the buddy that held its copy,
    or so many ranks that the mesh cannot shrink onto the rest. The message names the ranks; the
    job ends, and resumes from its last checkpoint (``hpf train --resume``)."""


class StoreValueError(ValueError):
    """A value in the process group's store that no hpf rank wrote: too big, too deep, or not a
    schedule log. The store may be reachable by others (a TCPStore listens on every interface),
    so its values are read as bounded JSON data, never unpickled; the message names the key and
    the rank whose key it is."""


class RankError(RuntimeError):
    """A rank raised, died, or a launch timed out; `rank` is the rank blamed (None on timeout).

    When the rank raised, ``cause`` is its exception (None if it could not travel by pickle),
    and the RankError is also an instance of that exception's class where Python can make one
    class of both, so ``except hpf.ParamsMismatchError`` works across ``hpf.launch``."""

    def __init__(self, message: str, rank: int | None = None, child_traceback: str = "",
                 cause: BaseException | None = None):
        super().__init__(message)
        self.rank = rank
        self.child_traceback = child_traceback
        self.cause = cause


class Terminated(SystemExit):
    """SIGTERM reached the process running ``hpf.launch`` (a scheduler's stop): the ranks were
    stopped and their files removed; exits with 143 (128 + SIGTERM) unless caught."""

    def __init__(self):
        super().__init__(128 + signal.SIGTERM)


# -- files ---------------------------------------------------------------------------------------------
class CheckpointError(RuntimeError):
    """A checkpoint that cannot be saved or restored; the message names the path and the key."""
