"""KnobBank: the per-token state of every steered conversation as rows of numpy arrays, so that
one decode step's metrics update the belief, Φ and knobs of all its rows with array operations
(`observe_rows`), not a Python loop per row.

While a conversation's ControlState is leased here, the bank holds its truth: the entropy EMA,
baseline, token count, phase and rolling window of its BeliefState, and the knobs, direction,
streak and fail-soft count of its PhiController. `sync(state)` (and the lease's end, when the
last TokenKnobs of the state is dropped) writes them back into the objects and lets the row go,
so whoever reads the objects between generations (TurnControl, reports) reads them current.

The arithmetic is BeliefState.observe then PhiController.update (DefaultPolicy.next_phi), or
BeliefState.observe alone (NullPolicy.next_phi), in the same float64 operations: the scalar
methods stay the reference (tests/unit/test_control_knobs.py compares them on many rows).
A policy with its own next_phi is not batched here (see `batched`)."""

from __future__ import annotations

import threading
import weakref
from collections import deque

import numpy as np

from noesis.control.belief import EXPLOIT_NATS, EXPLORE_NATS, FAST_ALPHA, SLOW_ALPHA, WINDOW, Phase
from noesis.control.phi import Phi
from noesis.control.policy import ControlState, DefaultPolicy, NullPolicy

# Columns of KnobBank.rows, one row per leased state.
(EMA, BASELINE, TOKENS, PHASE, RECENT_COUNT, RECENT_HEAD,  # belief (NaN EMA/baseline: None)
 PHI_T, PHI_P, PHI_W, PHI_B, BASE_T, BASE_P, BASE_W, BASE_B,  # Φ now and where it started
 DIRECTION, STREAK, FAIL_SOFTS,  # the fast loop
 CLAMP, HYSTERESIS, BAND, MIN_GAP, FLOOR, MAX_W, MIN_THINK, MOVES,  # PhiConfig; MOVES: Default
 T_RATIO, P_RATIO) = range(27)  # fmt: skip  # the knobs: Φ's temperature, top_p over the base's
COLUMNS = 27
PHASES = (Phase.EXPLORE, Phase.EXPLOIT, Phase.TOOL_SEEKING)  # PHASE holds the index
_EXPLORE, _EXPLOIT, _TOOL_SEEKING = range(3)

# next_phi implementations the bank reproduces -> whether Φ moves (DefaultPolicy) or not.
_BATCHED = {DefaultPolicy.next_phi: True, NullPolicy.next_phi: False}


def batched(policy) -> bool:
    """Whether this policy's next_phi is one the bank reproduces (a subclass that overrides it
    is not: its rows go through the policy one at a time)."""
    return getattr(type(policy), "next_phi", None) in _BATCHED


class Lease:
    """A state's row in the bank, shared by the TokenKnobs of that state; `slot` is None once
    the bank let the row go (sync): the next observe leases a row again."""

    __slots__ = ("slot", "state", "end", "__weakref__")

    def __init__(self, slot: int, state: ControlState) -> None:
        self.slot: int | None = slot
        self.state = state
        self.end: weakref.finalize | None = None


class KnobBank:
    def __init__(self, capacity: int = 64) -> None:
        self.rows = np.zeros((capacity, COLUMNS))
        self.recent = np.zeros((capacity, WINDOW))  # ring buffers of the rolling variance
        self.free = list(range(capacity - 1, -1, -1))
        # id(state) -> its lease while a TokenKnobs holds it (the bank holds the state, so
        # its id stays its own)
        self.leases: weakref.WeakValueDictionary[int, Lease] = weakref.WeakValueDictionary()
        self.lock = threading.RLock()  # a lease may end (garbage) on another thread

    def lease(self, state: ControlState, moves: bool) -> Lease:
        """The state's row, loaded from its objects unless it is leased already."""
        with self.lock:
            lease = self.leases.get(id(state))
            if lease is not None and lease.slot is not None:
                return lease
            if not self.free:
                self._grow()
            slot = self.free.pop()
            self._load(slot, state, moves)
            lease = Lease(slot, state)
            lease.end = weakref.finalize(lease, self._release, slot, state)
            self.leases[id(state)] = lease
            return lease

    def sync(self, state: ControlState) -> None:
        """Write a leased state back into its objects and let its row go."""
        with self.lock:
            lease = self.leases.get(id(state))
            if lease is None or lease.slot is None:
                return
            assert lease.end is not None
            lease.end.detach()
            self._release(lease.slot, state)
            lease.slot = None

    def observe_rows(self, slots: np.ndarray, metrics: np.ndarray) -> np.ndarray:
        """One token per row: slots [N] int, metrics [N, NUM_METRICS] float64 (a NaN entropy:
        no metrics). Returns each row's Φ ratios [N, 2] (temperature, top_p over where Φ
        started, at most 1) just after its own token: rows of one state (branches of one
        conversation) apply in their order, as one at a time would."""
        with self.lock:
            ratios = np.empty((len(slots), 2))
            at = np.arange(len(slots))
            while len(slots):
                _, first = np.unique(slots, return_index=True)  # each state once per pass
                if len(first) == len(slots):
                    ratios[at] = self._observe(slots, metrics)
                    break
                first.sort()
                ratios[at[first]] = self._observe(slots[first], metrics[first])
                rest = np.ones(len(slots), dtype=bool)
                rest[first] = False
                slots, metrics, at = slots[rest], metrics[rest], at[rest]
            return ratios

    # ------------------------------------------------------------ the arithmetic

    def _observe(self, slots: np.ndarray, metrics: np.ndarray) -> np.ndarray:
        s = self.rows[slots]  # [N, COLUMNS]: a copy, written back at the end
        entropy = metrics[:, 0]
        with np.errstate(invalid="ignore"):
            seen = np.isfinite(entropy) & (entropy >= 0)  # BeliefState.observe takes it
            usable = np.isfinite(metrics).all(axis=1) & seen  # phi._usable
        self._belief(s, slots, entropy, seen)
        ready = usable & ~np.isnan(s[:, EMA]) & ~np.isnan(s[:, BASELINE])
        moves = s[:, MOVES] == 1  # NullPolicy's rows: the belief alone
        self._phi(s, moves & ready)
        fail = moves & ~ready  # fail-soft to the request's own knobs
        s[fail, PHI_T : PHI_B + 1] = s[fail, BASE_T : BASE_B + 1]
        s[fail, DIRECTION] = 0
        s[fail, STREAK] = 0
        s[fail, FAIL_SOFTS] += 1
        s[:, T_RATIO] = _ratio(s[:, PHI_T], s[:, BASE_T])
        s[:, P_RATIO] = _ratio(s[:, PHI_P], s[:, BASE_P])
        self.rows[slots] = s
        return s[:, T_RATIO : P_RATIO + 1]

    def _belief(self, s: np.ndarray, slots: np.ndarray, entropy: np.ndarray, seen) -> None:
        """BeliefState.observe on the rows whose entropy is usable."""
        h = entropy[seen]
        b = s[seen]
        ema, baseline = b[:, EMA], b[:, BASELINE]
        b[:, EMA] = np.where(np.isnan(ema), h, ema + FAST_ALPHA * (h - ema))
        b[:, BASELINE] = np.where(np.isnan(baseline), h, baseline + SLOW_ALPHA * (h - baseline))
        head = b[:, RECENT_HEAD].astype(np.int64)
        self.recent[slots[seen], head] = h
        b[:, RECENT_HEAD] = (head + 1) % WINDOW
        b[:, RECENT_COUNT] = np.minimum(b[:, RECENT_COUNT] + 1, WINDOW)
        b[:, TOKENS] += 1
        phase, ema = b[:, PHASE], b[:, EMA]
        free = phase != _TOOL_SEEKING
        phase = np.where(free & (ema > EXPLORE_NATS), _EXPLORE, phase)
        b[:, PHASE] = np.where(free & (ema < EXPLOIT_NATS), _EXPLOIT, phase)
        s[seen] = b

    def _phi(self, s: np.ndarray, rows: np.ndarray) -> None:
        """PhiController.update's fast loop on rows with usable metrics and a baseline."""
        p = s[rows]
        ema, baseline = p[:, EMA], p[:, BASELINE]
        gap = np.maximum(p[:, BAND] * baseline, p[:, MIN_GAP])
        direction = np.where(ema > baseline + gap, 1.0, np.where(ema < baseline - gap, -1.0, 0.0))
        p[:, STREAK] = np.where(direction == p[:, DIRECTION], p[:, STREAK] + 1, 1)
        p[:, DIRECTION] = direction
        move = (direction != 0) & (p[:, STREAK] >= p[:, HYSTERESIS])
        m = p[move]
        d = m[:, DIRECTION]
        scale = np.where(d > 0, 1 - m[:, CLAMP], 1 + m[:, CLAMP])
        floor = m[:, FLOOR]
        m[:, PHI_T] = _within(m[:, PHI_T] * scale, floor * m[:, BASE_T], m[:, BASE_T])
        m[:, PHI_P] = _within(m[:, PHI_P] * scale, floor * m[:, BASE_P], m[:, BASE_P])
        m[:, PHI_W] = _within(m[:, PHI_W] - d, 0, m[:, MAX_W])
        think = np.round(m[:, PHI_B] * (1 + m[:, CLAMP] * d))  # half to even, as round()
        m[:, PHI_B] = _within(think, m[:, MIN_THINK], 2 * m[:, BASE_B])
        m[:, STREAK] = 0  # the next move needs another full run of tokens
        p[move] = m
        s[rows] = p

    # ------------------------------------------------------------ objects <-> rows

    def _load(self, slot: int, state: ControlState, moves: bool) -> None:
        belief, phi, c = state.belief, state.phi, state.phi.config
        recent = list(belief.recent)[-WINDOW:]
        self.recent[slot, : len(recent)] = recent
        now, base = phi.phi, phi.base
        row = self.rows[slot]
        row[:] = 0
        row[EMA] = np.nan if belief.entropy_ema is None else belief.entropy_ema
        row[BASELINE] = np.nan if belief.baseline is None else belief.baseline
        row[TOKENS], row[PHASE] = belief.tokens, PHASES.index(belief.phase)
        row[RECENT_COUNT], row[RECENT_HEAD] = len(recent), len(recent) % WINDOW
        row[PHI_T : PHI_B + 1] = now.temperature, now.top_p, now.verify_width, now.think_budget
        row[BASE_T : BASE_B + 1] = (
            base.temperature,
            base.top_p,
            base.verify_width,
            base.think_budget,
        )
        row[DIRECTION], row[STREAK], row[FAIL_SOFTS] = phi.direction, phi.streak, phi.fail_softs
        row[CLAMP:MIN_THINK + 1] = (c.clamp, c.hysteresis, c.band, c.min_gap, c.floor,
                                    c.max_verify_width, c.min_think)  # fmt: skip
        row[MOVES] = moves
        row[T_RATIO] = _ratio(row[PHI_T : PHI_T + 1], row[BASE_T : BASE_T + 1])[0]
        row[P_RATIO] = _ratio(row[PHI_P : PHI_P + 1], row[BASE_P : BASE_P + 1])[0]

    def _release(self, slot: int, state: ControlState) -> None:
        """Write the row back into the state's objects; the row is free again."""
        with self.lock:
            row, belief, phi = self.rows[slot], state.belief, state.phi
            belief.entropy_ema = None if np.isnan(row[EMA]) else float(row[EMA])
            belief.baseline = None if np.isnan(row[BASELINE]) else float(row[BASELINE])
            belief.tokens, belief.phase = int(row[TOKENS]), PHASES[int(row[PHASE])]
            count, head = int(row[RECENT_COUNT]), int(row[RECENT_HEAD])
            ring = self.recent[slot]
            order = [(head - count + i) % WINDOW for i in range(count)]  # oldest first
            belief.recent = deque((float(ring[i]) for i in order), maxlen=belief.recent.maxlen)
            now = Phi(float(row[PHI_T]), float(row[PHI_P]), int(row[PHI_W]), int(row[PHI_B]))
            phi.phi = phi.base if now == phi.base else now
            phi.direction, phi.streak = int(row[DIRECTION]), int(row[STREAK])
            phi.fail_softs = int(row[FAIL_SOFTS])
            self.free.append(slot)

    def _grow(self) -> None:
        capacity = len(self.rows)
        self.rows = np.concatenate([self.rows, np.zeros((capacity, COLUMNS))])
        self.recent = np.concatenate([self.recent, np.zeros((capacity, WINDOW))])
        self.free.extend(range(2 * capacity - 1, capacity - 1, -1))


def _ratio(now: np.ndarray, start: np.ndarray) -> np.ndarray:
    """Φ's knob relative to where it started, at most 1 (1 where it started at 0)."""
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(start > 0, np.minimum(1.0, now / start), 1.0)


def _within(value, lo, hi):
    return np.minimum(np.maximum(value, lo), hi)


BANK = KnobBank()  # one per process: a conversation's state may be steered by any engine
