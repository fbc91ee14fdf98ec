"""Adaptive draft length: each row drafts as many tokens as its own acceptance so far pays for.

A round that drafts d tokens for a row costs, relative to a plain decoding step of the target,

    C(0) = 1,   C(d) = P(d + 1) + r + d * c  (d >= 1)

P(n) is what the target's pass over n positions costs against a one-token step, measured on this machine
the first time (calibrate.py; remembered per processor, threads, dtype and model): it is the term no
table gets right, since it depends on the hardware's matmul shapes (SmolLM2-135M in float32 at batch 1:
P(3) = 2.0 on an AMD EPYC core through F.linear, 1.3 through the few-row path; on an Intel Xeon with AMX
P(3) = 1.1 and P(5) = 1.6; a GPU at small batch, next to 1). `c` is what one more draft step costs and
`r` what a drafting round costs beyond its pass and its draft steps (the drafter's first step over the
accepted tokens, a round's bookkeeping), both measured with the decoder's drafter when the decoder is
built (calibrate.draft_costs: rounds timed at fixed draft lengths beside their target passes, remembered
per drafter architecture); a proposer without a module of its own (prompt lookup) takes c = 0 and
r = ROUND_OVERHEAD, and `round_cost` overrides r. The same timing keeps the rounds themselves, C_B(1..4)
for running batches of B = 1, 2 and 4 rows, and a round of such a batch (a row priced alone: B = 1) is
priced as timed (`round_price`; sizes between interpolated, larger batches and longer drafts by the model):
passes timed alone and a fitted line priced SmolLM2's D=4 round at 1.75 steps on an AMD EPYC core where it
cost 1.94, and served batches of 2-4 rows priced by the model decoded at 0.83x plain.

Where calibration is off (DRAFTSMITH_CALIBRATE=0) or `verify_cost` is given, the pass is linear instead:
C(d) = 1 + r + d * (c + v), with c the drafter's matmul weights per drafted token over the target's
(`DrafterKind.draft_cost`), `v`, `verify_cost`, what one more position costs the pass and `r`,
`round_cost`, fitted on the AMD CPU (VERIFY_COST and ROUND_COST, per device and weight width: at batch 1
on one thread fixed D=4 rounds cost 2.0-2.05 plain steps in every prompt category, and adaptive rounds
fit r about 0.4 beside c + v about 0.15: benchmarks/by_category.py).
With a per-token acceptance probability a, it emits

    E(d) = 1 + a + ... + a^d = (1 - a^(d+1)) / (1 - a)

tokens, so a row alone drafts d* = argmax over 0..D of E(d) / C(d) (d = 0, plain decoding, is worth 1).
`a` is the row's own estimate: accepted over offered draft tokens, counting the first rejected one, over
its recent drafting rounds (what came before a round weighted `decay` times less per token the round
offered: a window of about ten offered tokens, whatever the draft lengths), shrunk toward a prior of
`prior` worth `prior_weight` tokens; each row learns from its own rounds only. The window is counted in
tokens, not rounds, so that one-token rounds can back off: weighted 0.7 per round, ten one-token rounds
rejected in a row still left an estimate of 0.6 / (1 / 0.3 + 1) = 0.14, above the break-even of a D=1
round that costs 1.08 plain steps (SmolLM2 on an AMD EPYC core), so a row whose drafts were all
rejected drafted one token in every round and decoded at 0.93x plain (a simulation of that rule;
per token: 0.998x). A greedy row that joins a
running engine whose rows have drafted starts from what those rows saw instead of `prior` (the
acceptance over every row's recent rounds, `seen_decay` per round): a server learns its drafter's
usual acceptance, so a new request on a poorly accepted drafter does not begin by drafting at 0.6.
Sampled rows keep `prior`, which depends on nothing that ran before them.

In a running batch of B rows the round is one pass as wide as the longest draft, and its cost against B
one-token rows, P_B(n), grows with B (SmolLM2 in float32 on the Intel Xeon: 4 rows of 3 positions cost
more than 1.1 four-row steps), so with measured passes the batch's greedy rows draft one common length,
the one that emits the most tokens over all rows per unit of the round's cost at B (`lengths`): a fuller
batch drafts less, and from some size on not at all. Greedy tokens do not depend on draft lengths. A
sampled row's do (its random draws follow its rounds), so sampled rows are priced as if alone, at B = 1:
their lengths depend on nothing but their own acceptance and the stored costs (never on the batch or on
the timing of rounds), and a seeded sampled request repeats exactly whatever runs beside it.
Verification stays exact whatever the lengths.

Back-off: a row whose estimate says no draft pays decodes plainly, and still tries one draft token after
`wait` rounds to see whether its text has become predictable (a code block after prose, a quoted
passage); each probe that fails doubles the wait (up to MAX_WAIT), one that lifts the estimate back
resets it. Where drafts are rejected the overhead is then one draft token every MAX_WAIT rounds. In a
running batch a probe widens every row's pass, so the greedy rows probe together: when one's wait is over
all of them draft one token in that round, and a greedy request that joins backed off (the acceptance the
engine has seen does not pay) takes the running rows' schedule instead of probing at once.
"""

from __future__ import annotations

import torch

from draftsmith.speculative import kinds

MAX_WAIT = 32
# What one more verified position costs the target's pass, relative to a one-token decoding step, per
# device type and weight width (SmolLM2-135M on 2 CPU cores in float32: 0.07 at batch 1, 0.15 at batch 4,
# benchmarks/verify_cost.py; in bfloat16 on one AVX-512 BF16 core, where oneDNN runs a 5-token pass at
# about 1.1x a one-token step: 0.02; a GPU at small batch: next to nothing). Unknown devices: cpu's.
VERIFY_COST = {"cpu": 0.1, "cpu-16bit": 0.02, "cuda": 0.02}
# What a drafting round costs beyond its per-token costs, relative to a one-token step (CPU float32:
# fitted as the module docstring says; the rest are not fitted here: small guesses, since there a
# multi-token pass costs about what a one-token step does).
ROUND_COST = {"cpu": 0.4, "cpu-16bit": 0.1, "cuda": 0.05}
# With the target's passes measured on this machine (calibrate.py) and a proposer whose drafter cannot be
# timed (prompt lookup: no module of its own), what a drafting round costs beyond its pass: the
# bookkeeping of a speculative round over a plain step.
ROUND_OVERHEAD = {"cpu": 0.1, "cpu-16bit": 0.1, "cuda": 0.05}


def expected_tokens(acceptance: float, draft_len: int) -> float:
    """E(d): tokens a round emits when each draft token is accepted with probability `acceptance`."""
    return sum(acceptance ** i for i in range(draft_len + 1))


def pass_cost(pass_costs: dict[int, list[float]] | list[float] | None, positions: int, batch: int = 1) -> float:
    """A target pass over `positions` per row of a `batch`-row batch, relative to that batch's one-token
    step: measured (`pass_costs[batch][n - 1]`; a batch between two measured sizes interpolated, beyond the
    largest its costs; longer passes growing in proportion to the longest measured), or 1 where the
    per-token cost holds it. A plain list is batch 1's."""
    if not pass_costs:
        return 1.0
    return _interpolated({b: _positions_cost(costs, positions) for b, costs in by_batch(pass_costs).items()}, batch)


def by_batch(costs: dict[int, list[float]] | list[float] | None) -> dict[int, list[float]] | None:
    """Costs keyed by running batch size: a plain list is batch 1's (None stays None)."""
    return {1: costs} if isinstance(costs, list) else costs


def _interpolated(by_size: dict[int, float], batch: int) -> float:
    """The value at `batch` from values at measured batch sizes: between two of them linear, beyond them
    the nearest one's."""
    sizes = sorted(by_size)
    below = max((s for s in sizes if s <= batch), default=sizes[0])
    above = min((s for s in sizes if s >= batch), default=sizes[-1])
    low, high = by_size[below], by_size[above]
    return low if above == below else low + (high - low) * (batch - below) / (above - below)


def _positions_cost(costs: list[float], positions: int) -> float:
    if positions <= len(costs):
        return costs[positions - 1]
    return costs[-1] * positions / len(costs)


def round_price(draft_len: int, cost: float, round_cost: float, pass_costs, batch: int = 1,
                round_costs: dict[int, list[float]] | list[float] | None = None) -> float:
    """C(d) of a round whose widest draft is `draft_len` (1 for 0): the decoder's timed round at this
    running batch where rounds were timed (`round_costs[B][d - 1]`; a batch between two timed sizes
    interpolated), else P_B(d + 1) + r + d * c. A plain list of timed rounds is batch 1's."""
    if draft_len == 0:
        return 1.0
    timed = timed_round(round_costs, draft_len, batch)
    if timed is not None:
        return timed
    return pass_cost(pass_costs, draft_len + 1, batch) + round_cost + draft_len * cost


def timed_round(round_costs: dict[int, list[float]] | list[float] | None, draft_len: int, batch: int) -> float | None:
    """C_B(d) from rounds timed at running batches around `batch` (interpolated between the two nearest
    timed sizes), or None where no timed size reaches `batch` or no timed round is `draft_len` long."""
    timed = {b: costs[draft_len - 1] for b, costs in (by_batch(round_costs) or {}).items() if draft_len <= len(costs)}
    if not timed or not min(timed) <= batch <= max(timed):
        return None
    return _interpolated(timed, batch)


def best_draft_len(acceptance: float, cost: float, max_len: int, round_cost: float = 0.0,
                   pass_costs: list[float] | None = None,
                   round_costs: dict[int, list[float]] | list[float] | None = None) -> int:
    """d* in 0..max_len maximising E(d) / C(d) for a row priced alone; the shortest on ties."""
    best, best_rate = 0, 1.0
    for d in range(1, max_len + 1):
        rate = expected_tokens(acceptance, d) / round_price(d, cost, round_cost, pass_costs, 1, round_costs)
        if rate > best_rate + 1e-12:
            best, best_rate = d, rate
    return best


class AdaptiveDraftLength:
    """Per-row acceptance estimates and draft lengths for a running batch (rows join and leave)."""

    def __init__(self, cost: float, *, round_cost: float = 0.0,
                 pass_costs: dict[int, list[float]] | list[float] | None = None,
                 round_costs: dict[int, list[float]] | list[float] | None = None, decay: float = 0.9,
                 prior: float = 0.6, prior_weight: float = 1.0, seen_decay: float = 0.98):
        pass_costs = by_batch(pass_costs)
        if cost < 0 or round_cost < 0 or any(c <= 0 for costs in (pass_costs or {}).values() for c in costs):
            raise ValueError(f"draft costs must be >= 0, got {cost} per token and {round_cost} per round "
                             f"(and passes > 0: {pass_costs})")
        self.cost, self.round_cost, self.pass_costs = cost, round_cost, pass_costs
        self.round_costs = by_batch(round_costs)  # {B: C_B(1..k)}: the decoder's timed rounds per batch, or None
        self.decay, self.prior, self.prior_weight, self.seen_decay = decay, prior, prior_weight, seen_decay
        self.seen_accepted = self.seen_offered = 0.0  # every row's decayed accepted / offered draft tokens
        self.seen_backoff = 1  # the wait after the latest failed probe of any greedy row (1 after a lift)
        self.priors: list[float] = []  # per row: the acceptance it started from
        self.accepted: list[float] = []  # per row: decayed accepted draft tokens
        self.offered: list[float] = []  # per row: decayed offered ones (up to the first rejected)
        self.wait: list[int] = []  # per row: plain rounds left before the next probe
        self.backoff: list[int] = []  # per row: the wait after the next failed probe
        self.cap: list[int] = []  # per row: its latest most draft tokens (D, within its budget)
        self.alone: list[bool] = []  # per row: its lengths must not depend on the batch (sampled rows)

    def add_rows(self, n: int, alone: list[bool] | None = None) -> None:
        """`n` rows join; `alone[i]`: row i is priced as if it ran alone (see `lengths`)."""
        self.accepted += [0.0] * n
        self.offered += [0.0] * n
        self.wait += [0] * n
        self.backoff += [1] * n
        self.cap += [1] * n
        self.alone += list(alone) if alone is not None else [False] * n
        self.priors += [self.prior if a else self.starting_acceptance() for a in self.alone[-n:]]
        # A greedy row that starts backed off (the acceptance the running rows saw does not pay for drafts)
        # joins the running rows' probe schedule instead of probing at once: in a batch every probe widens
        # the whole batch's pass, so the rows' probes are made in the same rounds (`lengths`).
        cap, running = max(self.cap, default=1), len(self.alone) - n
        starting = [b for b in range(running, len(self.alone))
                    if not self.alone[b] and self.seen_offered > 0 and self._best_alone(b, cap) == 0]
        if starting:
            waits = [self.wait[b] for b in range(running) if not self.alone[b] and self._best_alone(b, cap) == 0]
            for b in starting:
                self.wait[b], self.backoff[b] = min(waits, default=self.seen_backoff), self.seen_backoff

    def starting_acceptance(self) -> float:
        """What a joining greedy row starts from: the acceptance every row saw lately, shrunk toward
        `prior` as a row's estimate is."""
        return (self.seen_accepted + self.prior * self.prior_weight) / (self.seen_offered + self.prior_weight)

    def select(self, rows: list[int]) -> None:
        """Keep these rows, in this order (the others left the batch)."""
        for name in ("accepted", "offered", "wait", "backoff", "cap", "alone", "priors"):
            values = getattr(self, name)
            setattr(self, name, [values[b] for b in rows])

    def acceptance(self, b: int) -> float:
        return (self.accepted[b] + self.priors[b] * self.prior_weight) / (self.offered[b] + self.prior_weight)

    def lengths(self, max_lens: list[int]) -> list[int]:
        """This round's draft length per row, within `max_lens` (each row's D and budget).

        Rows priced alone (sampled rows: a seeded one must repeat exactly whatever runs beside it) draft
        what pays for a batch of one. The others share the round: the batch's verification pass is as wide
        as its longest draft, so with measured passes they draft one common length m (each within its
        cap), the m that emits the most tokens over all rows per unit of the round's cost at the running
        batch's size B, C_B(w) for the widest draft w (`round_price`: as timed, else the model; 1 for
        w = 0). A pass over B rows
        of n positions costs more against B one-token rows than one row's does, so a fuller batch drafts
        less, and from some size not at all. Greedy rows emit the same tokens whatever they draft."""
        lens = [self._alone_length(b, cap) if self.alone[b] or self.pass_costs is None else 0
                for b, cap in enumerate(max_lens)]
        shared = [b for b, cap in enumerate(max_lens) if cap > 0 and not self.alone[b] and self.pass_costs]
        if not shared:
            return lens
        for b in shared:
            self.cap[b] = max_lens[b]
        batch, fixed, sharing = len(max_lens), max(lens), set(shared)
        best, best_rate = 0, None
        for m in range(max(max_lens[b] for b in shared) + 1):
            tokens = sum(expected_tokens(self.acceptance(b), min(m, max_lens[b]) if b in sharing else lens[b])
                         for b in range(batch))
            width = max(m, fixed)
            cost = round_price(width, self.cost, self.round_cost, self.pass_costs, batch, self.round_costs)
            if best_rate is None or tokens / cost > best_rate + 1e-12:
                best, best_rate = m, tokens / cost
        if best > 0:
            for b in shared:
                lens[b] = min(best, max_lens[b])
            return lens
        # Backed-off rows (their own drafts do not pay even alone) probe in the same rounds: once one's wait
        # is over the pass is two positions wide for the whole batch anyway, so every shared row drafts one
        # token in it (the others count their waits down), and a batch pays for one wide round, not one per row.
        backed = [b for b in shared if self._best_alone(b, max_lens[b]) == 0]
        if any(self.wait[b] <= 0 for b in backed):
            for b in shared:
                lens[b] = 1
        else:
            for b in backed:
                self.wait[b] -= 1
        return lens

    def _alone_length(self, b: int, cap: int) -> int:
        """A row's length priced as if it ran alone: what pays at batch 1, else a probe when one is due."""
        if cap <= 0:
            return 0
        self.cap[b] = cap
        d = self._best_alone(b, cap)
        return d if d > 0 else self._probe(b)

    def _best_alone(self, b: int, cap: int) -> int:
        """What row b's acceptance pays for within `cap`, priced as a batch of one."""
        return best_draft_len(self.acceptance(b), self.cost, cap, self.round_cost, self.pass_costs, self.round_costs)

    def _probe(self, b: int) -> int:
        """A backed-off row drafts one token once its wait is over (else counts the wait down)."""
        if self.wait[b] > 0:
            self.wait[b] -= 1
            return 0
        return 1

    def observe(self, drafted: list[int], accepted: list[int]) -> None:
        """A round's outcome: per row the draft tokens offered and how many were accepted."""
        self.seen_accepted *= self.seen_decay
        self.seen_offered *= self.seen_decay
        for b, (d, a) in enumerate(zip(drafted, accepted)):
            if d <= 0:
                continue
            took, offered = min(a, d), min(a + 1, d)
            keep = self.decay ** offered  # per offered token (see the module docstring)
            self.accepted[b] = keep * self.accepted[b] + took
            self.offered[b] = keep * self.offered[b] + offered
            self.seen_accepted += took
            self.seen_offered += offered
            # Drafting does not pay (now) at the row's D: a per-round cost may pay only over longer drafts.
            if self._best_alone(b, max(self.cap[b], 1)) == 0:
                self.wait[b], self.backoff[b] = self.backoff[b], min(2 * self.backoff[b], MAX_WAIT)
                if not self.alone[b]:
                    self.seen_backoff = self.backoff[b]
            else:
                self.wait[b], self.backoff[b] = 0, 1
                if not self.alone[b]:
                    self.seen_backoff = 1


def adaptive_lengths(options, decoder) -> AdaptiveDraftLength | None:
    """The policy for a decoder's run under `options` (a DecodeOptions), or None when it is off."""
    if not options.adaptive or decoder.proposer is None:
        return None
    proposer, target = decoder.proposer, decoder.target
    device = cost_key(decoder.device, next(target.parameters()).dtype)
    draft = kinds.of(proposer).draft_cost(proposer, target)
    if options.verify_cost is None:
        decoder.measure_costs()  # (done when the decoder was built, unless it was built without)
    if options.verify_cost is None and decoder.pass_costs is not None:
        measured = decoder.draft_costs  # the drafter's steps and round overhead, measured with the passes
        if measured is not None:
            draft = measured["per_token"]
        overhead = (measured["per_round"] if measured is not None and options.round_cost is None
                    else _given_or_device(options.round_cost, ROUND_OVERHEAD, device))
        # Timed rounds price their batches as they are, unless a round cost is given (it prices the model's r).
        rounds = measured.get("rounds") if measured is not None and options.round_cost is None else None
        return AdaptiveDraftLength(draft, round_cost=overhead, pass_costs=decoder.pass_costs, round_costs=rounds)
    verify = _given_or_device(options.verify_cost, VERIFY_COST, device)
    per_round = _given_or_device(options.round_cost, ROUND_COST, device)
    return AdaptiveDraftLength(draft + verify, round_cost=per_round)


def cost_key(device, dtype) -> str:
    """The row of the cost tables for a target on `device` in `dtype`: the device type, and on CPU
    "cpu-16bit" for 16-bit weights (a multi-token pass costs far less there than in float32)."""
    kind = getattr(device, "type", str(device))
    return "cpu-16bit" if kind == "cpu" and dtype in (torch.bfloat16, torch.float16) else kind


def _given_or_device(given: float | None, per_device: dict[str, float], device: str) -> float:
    """An option's value, or when unset the device's (unknown devices: cpu's)."""
    return per_device.get(device, per_device["cpu"]) if given is None else given
