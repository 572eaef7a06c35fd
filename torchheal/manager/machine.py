"""When a step commits, and what a lighthouse notice does: the Manager's step machine (pure).

The Manager's threaded parts do things (wait for a quorum, move state, load it, abort a process
group, cut a build); every decision they act on is made here, from plain facts, with no I/O,
threads or clocks, so each rule can be read in one place and is checked by the scenario scripts
of ``tests/manager/machine_scenarios``.

:class:`StepMachine` is one rank's step: its counters, the warm-up, the heal (healing, torn,
the heal's target step), the vote, the salvage rule and the retry limit. :class:`Connection` is
the quorum the cross-replica process group connects and what each lighthouse :class:`Notice`
does to it and to a heal in flight. The invariants they keep are listed in
``docs/architecture.md`` ("The step machine").
"""

from __future__ import annotations

from dataclasses import dataclass

from torchheal.coordination.plan import Participation
from torchheal.coordination.types import Notice, NoticeKind
from torchheal.coordination.vote import Ballot, ballot, retry_limit_error

__all__ = [
    "NOT_A_LOSS",
    "Abort",
    "CancelBuild",
    "Connection",
    "EndHeal",
    "StepMachine",
    "salvage_refusal",
]

#: The refusal of a step whose failure no lost group explains (yet).
NOT_A_LOSS = "the failure was not the loss of a replica group"

#: Why a torn replica's step does not commit.
TORN = (
    "this replica's state was partly overwritten by a heal that failed; it must heal from a "
    "peer before it may commit"
)


def salvage_refusal(
    *,
    enabled: bool,
    errored: bool,
    foreign: bool,
    aborted_for: str | None,
    kept: int,
    healing: bool,
    contributed: bool,
    already_salvaged: bool,
    dropped: bool = False,
) -> str | None:
    """Why this step cannot be redone in a new quorum (None: it can; ``salvage_step``).

    Args:
        enabled: the Manager was asked to salvage.
        errored: the step failed.
        foreign: the training loop itself reported a failure (``report_error``): it stands.
        aborted_for: why the process group was aborted (None: it was not, so the failure is
            something else, which a new quorum would not cure).
        kept: allreduces kept this step.
        healing: this replica healed in this step (its inputs were zeros).
        contributed: this replica's data counted in this step.
        already_salvaged: this step was salvaged once already.
        dropped: the lighthouse dropped this group from the quorum: its peers redid the step
            without it, and it heals instead.
    """
    if not enabled or not errored:
        return "not enabled" if not enabled else "nothing failed"
    if foreign:
        return "the training loop reported an error"
    if already_salvaged:
        return "the step was salvaged once already"
    if healing or not contributed:
        return "this replica did not contribute to the step"
    if kept == 0:
        return "no allreduce was kept"
    if dropped:
        return "this group was dropped from the quorum"
    if aborted_for is None:
        return NOT_A_LOSS  # checked last: the one a short wait may change
    return None


class StepMachine:
    """One rank's step, as plain state: events in (methods), decisions out (return values).

    The training thread drives it; the quorum thread's event (:meth:`quorum_taken`) lands
    before the training thread reads what it wrote, as it waits for that quorum first.

    Args:
        min_replica_size: fewest participating replicas with which a step may commit.
        max_retries: failed commits in a row tolerated (None: no limit).
        salvage: ``salvage_step``: a step failed by a lost group is redone in a new quorum.
        warmup: this group (re)started into a running job: its first step runs alone.
    """

    def __init__(
        self, *, min_replica_size: int, max_retries: int | None, salvage: bool, warmup: bool
    ) -> None:
        self.min_replica_size = min_replica_size
        self.max_retries = max_retries
        self.salvage = salvage
        #: Committed steps (the first step is 0) and batches committed over all of them.
        self.step = 0
        self.batches_committed = 0
        #: Failed commits in a row (the retry limit's count; reported to the lighthouse).
        self.commit_failures = 0
        #: This step's contributors as seen from this replica; None before the first quorum.
        self.participation: Participation | None = None
        #: The next step is the warm-up (it joins no quorum), and this step is.
        self.warmup_pending = warmup
        self.warming_up = False
        #: This replica is behind and receives its state this step.
        self.healing = False
        #: The step of a heal this replica was part of and its counters have not reached yet.
        self.heal_target = 0
        #: A receive into this replica's own tensors failed part way: they hold a mix of old
        #: and unverified bytes until a heal succeeds.
        self.torn = False
        #: The counters before a heal overwrote them (restored if its load fails).
        self.pre_heal: tuple[int, int] | None = None
        #: This step was redone in a new quorum (salvaged).
        self.salvaged = False
        #: Why this replica must heal before it may commit (the divergence guard's verdict for
        #: this step: ``torchheal.manager.divergence``), and the step of its last heal.
        self.must_repair: str | None = None
        self.healed_at = -1

    # -- the step's start -----------------------------------------------------------------

    def begin(self) -> bool:
        """A step starts. Returns True when it is the warm-up: it joins no quorum, its
        collectives are local no-ops, it counts no participant and is not voted on."""
        self.healing = False
        self.pre_heal = None
        self.salvaged = False
        self.must_repair = None
        self.warming_up = self.warmup_pending
        self.warmup_pending = False
        if self.warming_up:
            self.participation = Participation(rank=None, count=0)
        return self.warming_up

    def end_warmup(self) -> bool:
        """The vote is asked for. Returns True when this step was the warm-up (no vote)."""
        was, self.warming_up = self.warming_up, False
        return was

    def quorum_taken(self, participation: Participation, *, healing: bool, max_step: int) -> bool:
        """The step's quorum is known, with this replica's part and whether it heals.

        Returns:
            True when a torn replica became the source at step 0: nothing trained yet, so its
            state is as good as any (refusing would bring the same plan back every round). It
            is no longer torn.
        """
        self.participation = participation
        untorn = self.torn and not healing and max_step == 0
        if untorn:
            self.torn = False
        if healing:
            self.healing = True
            self.heal_target = max(self.heal_target, max_step)
        return untorn

    def tore(self) -> bool:
        """A receive into this replica's own tensors failed part way. Returns True the first
        time (until a heal succeeds)."""
        first, self.torn = not self.torn, True
        return first

    def heal_arrived(self, batches_committed: int, max_step: int) -> None:
        """A healer's state arrived: its counters become the sender's, at the quorum's step."""
        self.pre_heal = (self.step, self.batches_committed)
        self.batches_committed = batches_committed
        self.step = max_step

    def loaded(self, ok: bool) -> None:
        """The received user state was loaded (``ok``) or its load failed: then the counters
        go back to what they were, so the next quorum heals this replica again."""
        if ok:
            self.torn = False
            self.healed_at = self.step
        elif self.pre_heal is not None:
            self.step, self.batches_committed = self.pre_heal
        self.pre_heal = None

    # -- the vote ----------------------------------------------------------------------

    def contributes(self) -> bool:
        """Whether this replica's data counts this step (not a spare, not healing)."""
        return self.participation is not None and self.participation.contributes(self.healing)

    def torn_error(self) -> str | None:
        """Why this step fails before the vote (a torn replica's, or one the divergence guard
        found outside the reference state: it heals from it at the next quorum), or None."""
        return TORN if self.torn else self.must_repair

    def ballot(self, errored: bool) -> Ballot:
        """This rank's vote (``vote.ballot``): after a heal that failed here, on the step its
        group healed to."""
        count = 0 if self.participation is None else self.participation.count
        choice = ballot(
            step=self.step,
            heal_target=self.heal_target,
            num_participants=count,
            min_replica_size=self.min_replica_size,
            errored=errored,
        )
        self.heal_target = choice.heal_target
        return choice

    def salvage_refusal(
        self, *, errored: bool, foreign: bool, kept: int, aborted_for: str | None, dropped: bool
    ) -> str | None:
        """Why a redo of this step in a new quorum would not cure it (None: it would)."""
        return salvage_refusal(
            enabled=self.salvage,
            errored=errored,
            foreign=foreign,
            aborted_for=aborted_for,
            kept=kept,
            healing=self.healing,
            contributed=self.contributes(),
            already_salvaged=self.salvaged,
            dropped=dropped,
        )

    def redo(self) -> None:
        """The group redoes the step in a new quorum (once)."""
        self.salvaged = True

    def decided(self, decision: bool) -> str | None:
        """The group's decision. A commit advances the counters; a failure counts toward the
        retry limit.

        Returns:
            The fatal error once more than ``max_retries`` commits in a row failed, else None.
        """
        if decision:
            self.step += 1
            self.batches_committed += 0 if self.participation is None else self.participation.count
            self.commit_failures = 0
            return None
        self.commit_failures += 1
        return retry_limit_error(self.commit_failures, self.max_retries)


# -- notices ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Abort:
    """Abort the process group built for ``quorum_id``, and end what is pending in it."""

    replica_id: str
    quorum_id: int
    why: str
    dropped: bool
    routine: bool  # a peer that said goodbye finished its job: logged at INFO


@dataclass(frozen=True)
class CancelBuild:
    """Abandon the process-group build under way (its peers abandon theirs)."""

    replica_id: str
    quorum_id: int
    dropped: bool


@dataclass(frozen=True)
class EndHeal:
    """End at once a heal whose source is ``replica_id`` (a socket shutdown)."""

    replica_id: str
    quorum_id: int
    reason: str


Action = Abort | CancelBuild | EndHeal

#: Quorums whose lost groups are remembered (a notice may come before its quorum is built).
REMEMBERED_QUORUMS = 16


@dataclass
class _Build:
    quorum_id: int
    members: frozenset[str]
    lost: str | None = None


class Connection:
    """The quorum the cross-replica process group connects, and what a notice does to it.

    The shell (``failfast.ConnectedQuorum``) calls it under one lock from the quorum thread
    and the notice thread, and performs the actions it returns.
    """

    def __init__(self) -> None:
        #: The quorum the process group was configured for (-1: none, or it was aborted).
        self.quorum_id = -1
        #: The replica groups it connects.
        self.members: frozenset[str] = frozenset()
        #: Why the group was last aborted or its build abandoned, until the next adoption.
        self.aborted_for: str | None = None
        #: Whether that abort was for this group's own drop (no redo in a new quorum cures it).
        self.dropped = False
        self.build: _Build | None = None
        self._lost: dict[int, set[str]] = {}

    def on_notice(self, notice: Notice, step: int = 0) -> list[Action]:
        """What a lighthouse notice does (the one place), to a rank at ``step``.

        * ``lost`` (or a rank of ours gave that build up): a heal from that group ends, a build
          of that quorum is abandoned and a group built for it aborted.
        * ``dropped`` (this group): the peers redid the step without it, so its build is
          abandoned and its group aborted.
        * ``superseded``: a build is abandoned, but a built group is kept (its peers completed
          the step with it).
        * ``lost`` by a goodbye after committing this rank's step (``steps_done > step``): the
          group is kept, so a group whose job ends first does not fail its peers' last step.
        """
        kind, replica, quorum = notice.kind, notice.replica_id, notice.quorum_id
        self._remember_lost(replica, quorum)  # a build of that quorum that starts later fails
        own = kind is NoticeKind.DROPPED or kind is NoticeKind.SUPERSEDED
        actions: list[Action] = []
        if kind is NoticeKind.LOST:
            actions.append(EndHeal(replica, quorum, notice.reason))
        build = self.build
        if build is not None and build.quorum_id == quorum and (own or replica in build.members):
            if build.lost is None:
                build.lost = replica
                actions.append(CancelBuild(replica, quorum, dropped=own))
            return actions
        if build is not None and own:
            return actions  # a build of another quorum released the group in use already
        if quorum != self.quorum_id or kind is NoticeKind.SUPERSEDED:
            return actions  # not our group's quorum (or kept: see above)
        if not own and replica not in self.members:
            return actions
        if kind is NoticeKind.LOST and notice.steps_done > step:
            return actions  # it finished this step before it left (see above)
        self.quorum_id, self.members = -1, frozenset()  # the next quorum rebuilds the group
        actions.append(self._abort(replica, quorum, notice.reason, dropped=own))
        return actions

    def start_build(self, quorum_id: int, members: frozenset[str]) -> str | None:
        """A build for ``quorum_id`` starts. Returns a lost member (the build must not run)."""
        lost = self._lost.get(quorum_id, set()) & members
        if lost:
            return sorted(lost)[0]
        self.build = _Build(quorum_id, members)
        return None

    def end_build(self) -> str | None:
        """The build ended. Returns the member it was abandoned for, or None."""
        build, self.build = self.build, None
        return None if build is None else build.lost

    def abandoned(self, why: str) -> None:
        """A build was abandoned for a lost member (no group to abort)."""
        self.aborted_for = why

    def adopt(self, quorum_id: int, members: frozenset[str]) -> Abort | None:
        """The process group was rebuilt for ``quorum_id``. Returns an abort when a member was
        lost meanwhile (the build ran to its end anyway: the group must not be used)."""
        lost = self._lost.get(quorum_id, set()) & members
        if not lost:
            self.quorum_id, self.members = quorum_id, members
            self.aborted_for, self.dropped = None, False
            return None
        self.quorum_id, self.members = -1, frozenset()
        return self._abort(
            sorted(lost)[0], quorum_id, "before the process group was adopted", dropped=False
        )

    def _abort(self, replica_id: str, quorum_id: int, reason: str, dropped: bool) -> Abort:
        if dropped:
            why = f"this group was dropped from quorum {quorum_id} ({reason})"
        else:
            why = f"replica group {replica_id} of quorum {quorum_id} is lost ({reason})"
        self.aborted_for, self.dropped = why, dropped
        routine = not dropped and reason.startswith("left")
        return Abort(replica_id, quorum_id, why, dropped, routine)

    def _remember_lost(self, replica_id: str, quorum_id: int) -> None:
        self._lost.setdefault(quorum_id, set()).add(replica_id)
        while len(self._lost) > REMEMBERED_QUORUMS:
            del self._lost[min(self._lost)]
