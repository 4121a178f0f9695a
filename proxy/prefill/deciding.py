"""How the prefill policy decides, on its state (policy_state.py): a request judged as it arrives
(rules 1-3, and rule 19's trim piece), a request sent with the reason its record gives, and
`advance`, the steps taken until nothing changes: restores take a freed slot first, then the
requests held for one, then the cold plans (rules 4-7, 12 and 14). Pure; the policy's events call it.
"""

from __future__ import annotations

from proxy.prefill.cold import split_reason, stall_reason
from proxy.prefill.events import Admit, Arrived, Decision, FeedPiece, Forward, Hold, Reject, Restore
from proxy.prefill.held import HeldRequest
from proxy.prefill.policy_state import PolicyState

NOT_COLD = "not cold"
MODE_OFF = "prefill.mode off"
QUIET_REASONS = (NOT_COLD, MODE_OFF)
"""Admission reasons of the usual case, which the record leaves out of its `policy_note`."""

# ---- arrivals and releases ---------------------------------------------------------------


def arrive(st: PolicyState, req: Arrived, now: float) -> list[Decision]:
    """Rules 1-4 for a request arriving (or back from a restore, or from behind one)."""
    cfg, req_id = st.cfg, req.req_id
    background = req.background and not st.slots_scarce()  # rule 1: a slot to spare
    by_tokens = req.est_new_tokens >= cfg.cold_tokens
    by_stall = (None if cfg.mode == "off" or by_tokens
                else stall_reason(cfg, st.cost, req, st.n_batch,
                                  st.use.streams(), st.use.cells(), background))
    split = (None if cfg.mode == "off" or by_tokens or by_stall or background
             else split_reason(cfg, st.cost, req, st.n_batch, st.use.streams(), st.use.cells()))
    if len(st.plans) > cfg.max_waiting:
        by_stall = split = None  # cold by its stall only: sent whole rather than refused
    goes_now = cfg.mode == "off" or not (by_tokens or by_stall or split)
    taken = st.taken()
    if (st.line.claimed(now, taken, req.est_new_tokens)
            or (goes_now and st.line.full(taken))):
        return [Hold(req_id, st.line.hold(req, now))]
    if goes_now:
        if cfg.mode == "off":
            return _admit(st, req, MODE_OFF, now)
        return _trim(st, req, now) or _admit(st, req, NOT_COLD, now)
    idle = not (st.plans or st.use or st.warm_pieces or st.saving)
    if idle and cfg.mode == "defer":
        return _admit(st, req, "cold, nobody generating", now)
    if st.plans and len(st.plans) > cfg.max_waiting:
        st.notes.pop(req_id, None)
        return [Reject(req_id, f"{len(st.plans) - 1} cold requests already waiting "
                               f"(prefill.max_waiting = {cfg.max_waiting})")]
    why = ("nobody generating: fed in pieces back to back" if idle
           else "waiting for its turn" if st.plans else "others generating" if st.use
           else "a warm-up's piece in flight" if st.warm_pieces
           else "a save of kept KV in flight")
    if by_stall or split:  # the record says why it was cold, or split
        st.notes[req_id] = st.noted(req_id, by_stall or split or "")
    st.plans.held[req_id] = HeldRequest.for_request(req, cfg.max_hold_s, background,
                                                    split=split is not None)
    decided = advance(st, now)
    if decided and isinstance(decided[0], Admit) and decided[0].req_id == req_id:
        return decided  # released at once (rule 7: short enough to go whole; a split not paying)
    return [Hold(req_id, why), *decided]


def _trim(st: PolicyState, req: Arrived, now: float) -> list[Decision]:
    """Rule 19: its trim piece, if it pays; else nothing. Never on an estimate that counts a held
    reply not known to be found (bench day: 7 of 12 trim pieces computed 24-240 tokens, not one)."""
    if not st.cfg.trim_short_turns or req.guessed_tokens:
        return []
    cut = st.trims.cut(st.cost, req, st.use.decoders(), st.use.cells(), st.shared_kv,
                       n_batch=st.n_batch, n_ubatch=st.cfg.n_ubatch)
    if cut is None:
        return []
    st.line.land(req.req_id, now, started=True)
    st.notes[req.req_id] = st.noted(req.req_id, cut.reason())
    return [FeedPiece(req.req_id, cut.upto, trim=True)]


def release_trim(st: PolicyState, req: Arrived, failed: str | None, now: float) -> list[Decision]:
    """Rule 19: the trimmed turn goes, its trim piece done (or failed: as it came); the others
    wait for it as after a restore (rule 14): its slot, idle for a moment, holds what it
    needs, and its batch is to be short."""
    st.use.sent(req.req_id, now, req.est_prompt_tokens)
    st.line.land(req.req_id, now)
    if failed is not None:
        st.notes.pop(req.req_id, None)
        return [Forward(req.req_id, f"trim piece failed, forwarded as it came: {failed}")]
    return [Forward(req.req_id, st.notes.pop(req.req_id, "trimmed"))]


def _admit(st: PolicyState, req: Arrived, reason: str, now: float) -> list[Decision]:
    st.use.sent(req.req_id, now, req.est_prompt_tokens)
    return [Admit(req.req_id, st.noted(req.req_id, reason))]


def release(st: PolicyState, held: HeldRequest, decision: Admit | Forward,
            now: float) -> list[Decision]:
    """End a plan: its request goes upstream and counts as generating from now on."""
    req_id = decision.req_id
    st.plans.held.pop(req_id, None)
    st.use.sent(req_id, now, held.req.est_prompt_tokens)
    reason = st.noted(req_id, decision.reason)
    return [Admit(req_id, reason) if isinstance(decision, Admit) else Forward(req_id, reason)]


# ---- deciding ----------------------------------------------------------------------------


def advance(st: PolicyState, now: float) -> list[Decision]:
    """Apply rules 4-7, 12 and 14 until nothing changes: restores take a freed slot first,
    then the requests held for one, then the cold plans."""
    st.now = now
    out: list[Decision] = []
    while True:
        step = [*_restore_step(st, now), *_unclaim(st, now), *_plan_step(st, now)]
        if not step:  # a plan owed a slot may have gone into a hold: the slot is not its now
            step = _unclaim(st, now)
        if not step:
            return out
        out.extend(step)


def _restore_step(st: PolicyState, now: float) -> list[Decision]:
    out: list[Decision] = []
    for waiting in st.line.restores.expired(now):
        st.notes[waiting.req.req_id] = ("keep_kv: no slot came free to restore into "
                                        "in time, computed instead")
        out.extend(arrive(st, waiting.req, now))
    started = st.line.restores.start(0 if st.saving else st.line.free(st.taken()))
    return [*out, *(Restore(r) for r in started)]


def _unclaim(st: PolicyState, now: float) -> list[Decision]:
    """Rules 12 and 14: the requests held for a slot go in their order (arrival, background
    jobs after the chat turns for a while), one per free slot, once no restore claims it and
    no cold plan is owed it."""
    out: list[Decision] = []
    while True:
        owed = st.plans.slots_owed(st.server(), now)
        behind = st.line.next_behind(now, st.taken() + owed, st.cfg.max_hold_s)
        if behind is None:
            return out
        req, why = behind
        st.notes.setdefault(req.req_id, f"held {why.removeprefix('waiting ')}")
        out.extend(arrive(st, req, now))


def _plan_step(st: PolicyState, now: float) -> list[Decision]:
    step = st.plans.step(st.server(), now)
    if step is None:
        return []
    if isinstance(step, FeedPiece):
        return [step]
    return release(st, *step, now)
