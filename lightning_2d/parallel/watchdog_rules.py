"""The failure watchdog's rules as one pure function: ``decide(observations, state, limits) -> (state, verdict)``.

No thread, no store, no clock, no ``os`` call here: what a round saw (the time included) comes in ``Observations``,
what is remembered across rounds is ``State``, the thresholds are ``Limits``; ``parallel/watchdog.py`` is the shell
that gathers the observations, calls ``decide`` and does what the verdict says. The rules, in the order they apply:

========================================  ====================================================================
when                                      verdict
========================================  ====================================================================
a verdict is published and not yet held   hold it (``seen_at`` = now), then the rows below "a verdict is held"
no verdict; the store silent > limit      ``Publish``: the store's host (none: torchrun's agent hosts it)
the watched successor finished            watch the next rank of the ring (``done``)
the successor's process gone (this host)  ``Publish``: it died, within a round
successor silent or behind > limit, and   ``Publish``: that dead rank (a rank waiting on a dead one can look
  another rank on this host is gone        stuck; the dead one is the cause), unless its last heartbeat said
  without having finished                  it finished
successor silent > limit                  ``Publish``: silent (stopped, dead elsewhere), its process described
successor behind > limit, its heartbeat   ``Publish``: stuck (a stopped rank's stale heartbeat can look behind:
  changed within ``patience``              it is named silent instead, later)
this rank raised (not communication)      ``Publish``: its own error with its step, at once
this rank's collective failed             ``Wait`` for a cause: ``limit`` drops to ``settle``; a lag that began
                                            with the failure is not counted; after ``patience``, ``Publish``
                                            its own failure, saying no cause was found
a verdict is held; this rank failed by    ``Continue``: its own error ends it (a collective's failure: unless
  itself                                    the verdict names another rank, then ``End`` at once)
a verdict is held, raised on another      ``End`` after ``settle`` (an error raised everywhere at once is each
  rank                                      rank's own to report)
any other verdict held                    ``End``: exit ``EXIT_CODE``, kill a stopped culprit on this host,
                                            dump the stacks if named
========================================  ====================================================================

``limit`` is ``Limits.timeout``, or ``Limits.settle`` while this rank's collective failed. *Behind*: the successor has
not started the step this rank started (a step starts when ``optimizer_step`` is entered, under the Trainer before
the forward: a rank stuck in data loading, a callback or a save is behind; one stuck between two collectives of a
step is at the others' step, and the collectives' timeout ends it). ``departure`` says whom
the rank hosting the store waits for before it leaves (its exit takes the store along).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from typing import Callable, Mapping, Optional, Union

#: The exit code of a rank ended by the watchdog (``EX_TEMPFAIL``: resume from the last checkpoint).
EXIT_CODE = 75
GONE, STOPPED = (None, "Z", "X"), ("T", "t")  # process states (``/proc/PID/stat``; ``None``: no such process)
FINISHED, RUNNING = ("done", "ended"), ("alive", "failed")  # heartbeat statuses


@dataclass(frozen=True)
class Limits:
    """The thresholds, in seconds. ``Limits.of`` derives them all from the user's two timeouts."""

    timeout: float
    """The user's ``watchdog_timeout``: how long a rank may be silent or behind, or the store unanswering, before it
    is named. Not shortened: ordinary pauses (a slow save, a long first step) must not end a job."""
    bound: float
    """``min(watchdog_timeout, timeout)``: the job ends within it (+ a few rounds), neither timeout extended. The rank
    hosting the store waits this long at most for the others to finish after it finished."""
    interval: float
    """Seconds between two rounds: a tenth of ``bound``, in [0.2, 5] (the store sees ``O(world)`` operations per round).
    Also the margin that tells a lag that began with a failed collective from one that was there before."""
    settle: float
    """Two rounds: by then every live rank's watchdog has run a round. The grace a rank gives an error raised on
    another rank (its own may be coming: an error raised everywhere at once is each rank's own), and, once this
    rank's collective failed, the silence or lag that names the cause (it has lasted since the collective began)."""
    linger: float
    """Two rounds + 1 s (for a slow store call): after a verdict, how long the rank hosting the store waits at most
    for the others to read it (a live rank reads it in its next round) before its exit takes the store along."""
    patience: float
    """Three rounds + 1 s: a failed collective's wait for its cause (the cause is named after ``settle``, in the next
    round of the rank watching it, + 1 s for the store). A heartbeat changed within it is fresh: stuck needs a fresh
    heartbeat (a stopped rank's stale one can look behind: it is named silent instead, after ``timeout``)."""

    @classmethod
    def of(cls, watchdog_timeout: float, collective_timeout: Optional[float] = None) -> "Limits":
        """The limits for a ``watchdog_timeout`` and the process groups' ``timeout`` (``None``: none)."""
        bound = min(float(watchdog_timeout), collective_timeout or float("inf"))
        interval = min(5.0, max(0.2, bound / 10))
        return cls(float(watchdog_timeout), bound, interval, settle=2 * interval, linger=2 * interval + 1.0,
                   patience=3 * interval + 1.0)


@dataclass(frozen=True)
class Job:
    """Who is who: this ``rank``, every rank's (host, PID namespace, PID), the rank hosting the store (``None``:
    torchrun's agent does)."""

    rank: int
    processes: tuple[tuple[str, str, int], ...]
    store_host: Optional[int] = 0

    @property
    def local(self) -> tuple[int, ...]:
        """The other ranks on this host (PIDs compare only on one host inside one PID namespace)."""
        here = self.processes[self.rank][:2]
        return tuple(r for r, p in enumerate(self.processes) if r != self.rank and p[:2] == here)

    @property
    def others(self) -> tuple[int, ...]:
        return tuple(r for r in range(len(self.processes)) if r != self.rank)

    def who(self, rank: int) -> str:
        return f"rank {rank} (pid {self.processes[rank][2]} on {self.processes[rank][0]})"


@dataclass(frozen=True)
class Beat:
    """A rank's heartbeat: how many it wrote, the step it ``started``, the ``step`` it completed, its ``status``
    ("alive", "failed": waiting for a cause or reporting its error, "done": finished, "ended": by a verdict)."""

    count: int
    started: int
    step: int
    status: str

    @classmethod
    def parse(cls, raw: Union[bytes, str]) -> "Beat":
        count, started, step, status = (raw.decode() if isinstance(raw, bytes) else raw).split()
        return cls(int(count), int(started), int(step), status)

    def __str__(self) -> str:
        return f"{self.count} {self.started} {self.step} {self.status}"


@dataclass(frozen=True)
class Finding:
    """A verdict: the ``ranks`` named, the rank that found it (``by``), why; ``raised``: a rank's own error."""

    ranks: tuple[int, ...]
    by: int
    reason: str
    raised: bool = False

    def to_json(self) -> str:
        return json.dumps({"ranks": list(self.ranks), "by": self.by, "reason": self.reason,
                           **({"raised": True} if self.raised else {})})

    @classmethod
    def from_json(cls, text: Union[bytes, str]) -> "Finding":
        data = json.loads(text)
        return cls(tuple(data["ranks"]), data["by"], data["reason"], bool(data.get("raised")))


@dataclass(frozen=True)
class Failure:
    """This rank's main thread failed: when, whether a communication error (another rank's failure's consequence),
    the error's first line, the step it failed in."""

    at: float
    communication: bool
    error: str
    step: int


@dataclass(frozen=True)
class Observations:
    """What one call saw. A round of the watchdog's thread (``round``) wrote its heartbeat and read the store; the
    failing main thread's calls read no store (``round`` False: nothing judged)."""

    now: float
    started: int = 0
    """The step this rank entered (``optimizer_step``)."""
    store_answered_at: float = 0.0
    """When the store last answered one of this rank's calls."""
    states: Mapping[int, Optional[str]] = field(default_factory=dict)
    """The ``/proc`` state of each other rank on this host (``None``: gone)."""
    verdict: Optional[Finding] = None
    """The published verdict, if read (from the store, or what ``Publish`` left there)."""
    successor: Optional[tuple[int, Beat]] = None
    """The watched rank and its last heartbeat (``None``: not read)."""
    gone: Mapping[int, Optional[Beat]] = field(default_factory=dict)
    """The last heartbeats of the other ranks on this host whose process is gone (absent: the store did not answer)."""
    failure: Optional[Failure] = None
    round: bool = True


@dataclass(frozen=True)
class State:
    """What is remembered across calls: the held verdict and when it was seen, the ranks that finished (the ring skips
    them), and the watched successor's last heartbeat count, since when, and since when it is behind."""

    job: Job
    verdict: Optional[Finding] = None
    seen_at: float = 0.0
    done: frozenset[int] = frozenset()
    watched: int = -1
    count: int = -1
    since: float = 0.0
    behind_since: Optional[float] = None

    @property
    def successor(self) -> int:
        """The next rank of the ring that has not finished (this rank when none is left)."""
        world, rank = len(self.job.processes), self.job.rank
        return next((r for r in ((rank + k) % world for k in range(1, world)) if r not in self.done), rank)


@dataclass(frozen=True)
class Continue:
    """Nothing to do (a failing main thread: return and let its own error end the rank)."""


@dataclass(frozen=True)
class Wait:
    """This rank's collective failed: wait for its cause (call again)."""


@dataclass(frozen=True)
class Publish:
    """Write ``finding`` unless a verdict is there, then call again with the verdict that holds."""

    finding: Finding


@dataclass(frozen=True)
class End:
    """Print ``message``, dump this rank's stacks (``dump_stacks``: it is named, so alive but stuck), SIGKILL the
    ``kill`` ranks (stopped, on this host: they would hold their memory forever), leave, exit ``code``."""

    message: str
    dump_stacks: bool
    kill: tuple[int, ...]
    code: int = EXIT_CODE


Verdict = Union[Continue, Wait, Publish, End]


@dataclass(frozen=True)
class _Seen:
    """What the successor rules read: the observations, the state after tracking, the limit and its wording."""

    obs: Observations
    state: State
    beat: Beat
    limit: float
    why: str
    waiting: bool

    @property
    def rank(self) -> int:
        return self.state.watched

    @property
    def silence(self) -> float:
        return self.obs.now - self.state.since


def decide(obs: Observations, state: State, limits: Limits) -> tuple[State, Verdict]:
    """The rules of the module's table, applied to one call's observations."""
    if state.verdict is None and obs.verdict is not None:
        state = replace(state, verdict=obs.verdict, seen_at=obs.now)
    if state.verdict is None:
        finding = None
        if obs.round:
            state, finding = _judge(obs, state, limits)
        if finding is None and obs.failure is not None:
            finding = _own_finding(obs, state.job.rank, limits)
        if finding is not None:
            return state, Publish(finding)
        return state, Wait() if obs.failure is not None else Continue()
    return state, _act(obs, state, limits)


def own_reason(failure: Failure, rank: int, limits: Limits) -> str:
    """What this rank reports of its own failure (the verdict, when no other rank's came first)."""
    if failure.communication:
        return (f"rank {rank}'s collective failed during step {failure.step} ({failure.error}) and no rank was found"
                f" dead, stopped or stuck within {limits.patience:.0f} s")
    return f"rank {rank} raised {failure.error.replace(':', f' during step {failure.step}:', 1)}"


def _own_finding(obs: Observations, rank: int, limits: Limits) -> Optional[Finding]:
    """At once for an error raised here; for a failed collective, once ``patience`` passed without a cause."""
    failure = obs.failure
    if failure is None or failure.communication and obs.now < failure.at + limits.patience:
        return None
    return Finding((rank,), rank, own_reason(failure, rank, limits), raised=True)


def _act(obs: Observations, state: State, limits: Limits) -> Verdict:
    """A verdict is held: end this rank, or not (yet)."""
    verdict, rank, failure = state.verdict, state.job.rank, obs.failure
    assert verdict is not None
    if failure is not None:  # its own error ends it, unless a consequence of another rank's failure
        ends = failure.communication and rank not in verdict.ranks
    else:
        ends = not verdict.raised or rank in verdict.ranks or obs.now - state.seen_at >= limits.settle
    if not ends:
        return Continue()
    kill = tuple(r for r in verdict.ranks if r in state.job.local and obs.states.get(r) in STOPPED)
    return End(_end_message(verdict, rank, failure), dump_stacks=rank in verdict.ranks, kill=kill)


def _end_message(verdict: Finding, rank: int, failure: Optional[Failure]) -> str:
    line = (f"Stopping rank {rank} (exit code {EXIT_CODE}): {verdict.reason}"
            + (f" [found by rank {verdict.by}]" if verdict.by not in (rank, *verdict.ranks) else "")
            + ". Resume from the last complete checkpoint (ckpt_path='last').")
    if failure is None:
        return line
    return line + f"\nThis rank's own error ({'a consequence' if failure.communication else 'raised here'}): {failure.error}"


def _judge(obs: Observations, state: State, limits: Limits) -> tuple[State, Optional[Finding]]:
    """The store silent, or the watched successor gone (on this host), silent or behind, longer than the limit?"""
    job, now = state.job, obs.now
    waiting = obs.failure is not None and obs.failure.communication
    limit, why = (limits.settle, f"(and rank {job.rank}'s collective failed)") if waiting else (
        limits.timeout, f"(watchdog timeout {limits.timeout:.0f} s)")
    if state.successor != state.watched:
        state = replace(state, watched=state.successor, count=-1, since=now, behind_since=None)
    if now - obs.store_answered_at > limit:
        return state, _store_silent(obs, job, why)
    beat = obs.successor[1] if obs.successor and obs.successor[0] == state.watched != job.rank else None
    if beat is None:
        return state, None
    if beat.status in FINISHED:
        return replace(state, done=state.done | {state.watched}), None  # the next call watches the next rank
    state = _track(state, beat, obs)
    seen = _Seen(obs, state, beat, limit, why, waiting)
    return state, next((f for f in (rule(seen, limits) for rule in SUCCESSOR_RULES) if f is not None), None)


def _track(state: State, beat: Beat, obs: Observations) -> State:
    """Since when the successor's heartbeat count has not changed, and since when it is behind this rank's step."""
    since = obs.now if beat.count != state.count else state.since
    behind = None if beat.started >= obs.started else obs.now if state.behind_since is None else state.behind_since
    return replace(state, count=beat.count, since=since, behind_since=behind)


def _store_silent(obs: Observations, job: Job, why: str) -> Finding:
    """The store has not answered for longer than the limit: its host is named (none: torchrun's agent hosts it)."""
    host = job.store_host
    where = "the torchrun agent" if host is None else f"rank {host} (MASTER_ADDR)"
    return Finding(() if host is None else (host,), job.rank, (
        f"the job's store (hosted by {where}) has not answered for {obs.now - obs.store_answered_at:.0f} s"
        f" {why}{_describe(obs, job, host)}"))


def _gone(seen: _Seen, limits: Limits) -> Optional[Finding]:
    """Its process is gone (on this host: ``/proc``): within a round."""
    r, job = seen.rank, seen.state.job
    if r in job.local and seen.obs.states.get(r) in GONE:
        return Finding((r,), job.rank, f"{job.who(r)} died: its process is gone{_steps(seen.beat)}")
    return None


def _dead_on_host(seen: _Seen, limits: Limits) -> Optional[Finding]:
    """Silence or a lag may be waiting on a rank that died (a save or a collective with it): a dead rank on this host
    is the cause, whichever rank watches it (the race seen: rank 3 named stuck while rank 1 was dead). A rank whose
    last heartbeat says it finished is not dead; one whose heartbeat could not be read is not judged."""
    if seen.silence <= seen.limit and seen.state.behind_since is None:
        return None
    job, state = seen.state.job, seen.state
    for d in job.local:
        if d != seen.rank and d not in state.done and seen.obs.states.get(d) in GONE and d in seen.obs.gone:
            beat = seen.obs.gone[d]
            if beat is None or beat.status not in FINISHED:
                return Finding((d,), job.rank, f"{job.who(d)} died: its process is gone")
    return None


def _silent(seen: _Seen, limits: Limits) -> Optional[Finding]:
    """No new heartbeat for longer than the limit (stopped, dead on another host, its watchdog stuck)."""
    if seen.silence <= seen.limit:
        return None
    job = seen.state.job
    return Finding((seen.rank,), job.rank, (f"{job.who(seen.rank)} has sent no heartbeat for {seen.silence:.0f} s"
                                            f" {seen.why}{_describe(seen.obs, job, seen.rank)}{_steps(seen.beat)}"))


def _stuck(seen: _Seen, limits: Limits) -> Optional[Finding]:
    """Behind the step this rank started for longer than the limit, its heartbeat fresh (else it is stopped). While
    this rank's collective failed, a lag that began with the failure is not counted (the collective's own wait)."""
    behind, failure = seen.state.behind_since, seen.obs.failure
    if behind is None or seen.waiting and failure is not None and behind > failure.at - limits.interval:
        return None
    lag = seen.obs.now - behind
    if lag <= seen.limit or seen.silence > limits.patience:
        return None
    job = seen.state.job
    return Finding((seen.rank,), job.rank, (
        f"{job.who(seen.rank)} is stuck at step {seen.beat.started} (others at step {seen.obs.started}) for {lag:.0f} s"
        f" {seen.why}: alive (its heartbeat beats) but not progressing"))


#: The rules on the watched successor, in order: the first finding is published.
SUCCESSOR_RULES: tuple[Callable[[_Seen, Limits], Optional[Finding]], ...] = (_gone, _dead_on_host, _silent, _stuck)


def _steps(beat: Beat) -> str:
    return f"; its last heartbeat reported {beat.step} completed step(s)"


def _describe(obs: Observations, job: Job, rank: Optional[int]) -> str:
    """What can be seen of a silent rank's process from here."""
    if rank is None or rank == job.rank:
        return ""
    if rank not in job.local:
        return " (another host: stopped, dead or cut off)"
    state = obs.states.get(rank)
    if state in GONE + STOPPED:
        return f": its process is {'stopped (SIGSTOP/SIGTSTP)' if state in STOPPED else 'gone'}"
    return f": its process is alive (state {state}) but its watchdog does not run"


def departure(state: State, states: Mapping[int, Optional[str]], now: float, limits: Limits,
              finished: bool) -> tuple[tuple[int, ...], float]:
    """Whom this rank waits for before it leaves, and until when: nobody unless it hosts the store (its exit takes
    the store along, and a rank not done with it would take that for a new failure). It waits while one of them is
    "alive" or "failed" (waiting for a cause): after finishing, ``bound`` at most; after a verdict, ``linger``
    after it was seen, not for culprits that raised, are stopped, gone or on another host (need not read it), nor
    for any rank on this host whose process is gone (it reads nothing more: a rank that raised its own error, as every
    rank does when all stop on the same error, stays "failed" in the store, and waiting for it cost ``linger``)."""
    job, verdict = state.job, state.verdict
    if job.store_host != job.rank:
        return (), now
    if finished or verdict is None:
        return job.others, now + limits.bound
    gone = {r for r in job.local if states.get(r) in GONE}
    skip = set(verdict.ranks) if verdict.raised else {
        r for r in verdict.ranks if r not in job.local or states.get(r) in GONE + STOPPED}
    return tuple(r for r in job.others if r not in skip | gone), state.seen_at + limits.linger
