"""Whether the replica groups hold the same state, and who repairs when not: the guard (pure).

Participants fingerprint the state they would send a healer (:mod:`torchheal.manager.fingerprint`)
and exchange fingerprints in one small collective (:mod:`torchheal.manager.guard`). This module
decides, from plain data, when an exchange is due, the layout of its words, and the verdict.

**When.** A collective hangs unless every member runs it, so the rule uses only what every member
of the quorum knows alike. An exchange runs only when every participant advertises the same
settings in its replica id (:func:`advertise`, :func:`agreed`; a reference group advertises
nothing), never in a step where someone heals (everyone would wait for the transfer), and then on
the first step of each quorum id, the first step after a heal, and every ``interval``-th step.

**Who.** Members at the quorum's step that could read their state; each rank compares its shard
with the same rank of the other groups.

**The verdict.** The largest class of equal fingerprints is the reference; ties go to the class
that healed least recently (its heal is the likeliest cause), then to the lowest rank. Members
outside it ``repair`` (vote no on the next step and heal from the reference class), ``stop``, or
only ``warn``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = [
    "FORMAT",
    "HEADER",
    "MAX_KEYS",
    "POLICIES",
    "GuardSettings",
    "Schedule",
    "Slot",
    "Verdict",
    "advertise",
    "advertised",
    "agreed",
    "combine",
    "decode",
    "differing_tensors",
    "encode",
    "judge",
    "name_hash",
    "slot_words",
    "tensor_count",
    "tensor_words",
]

#: What a mismatch does (the first is the default).
POLICIES = ("repair", "stop", "warn")

#: The version of the fingerprint and of the exchanged words: groups compare only with groups
#: that advertise the same (raise it whenever either changes).
FORMAT = 1

#: The default interval (``divergence_check_interval`` and its variable unset).
DEFAULT_INTERVAL = 100

#: Words of a slot's header: present, interval, policy, step, eligible, last heal + 1,
#: number of keys, number of tensors.
HEADER = 8
#: Fingerprint entries per slot (name hash, sum, weighted sum); later keys share the last.
MAX_KEYS = 24

#: Most tensors compared one by one after a mismatch (the second exchange's size bound).
MAX_TENSORS = 1 << 16

_MASK = (1 << 64) - 1


@dataclass(frozen=True)
class GuardSettings:
    """The guard's settings (every group must pass the same, or the guard stays off).

    Args:
        interval: compare every ``interval`` committed steps (None or 0: off).
        policy: ``repair``, ``stop`` or ``warn``.
    """

    interval: int | None = DEFAULT_INTERVAL
    policy: str = "repair"

    def validate(self) -> None:
        """Raises ValueError naming the bad field."""
        if self.interval is not None and not 0 <= self.interval < 1 << _INTERVAL_BITS:
            raise ValueError(
                f"divergence_check_interval must be >= 0 (0: off) and < 2**{_INTERVAL_BITS}, "
                f"got {self.interval}"
            )
        if self.policy not in POLICIES:
            raise ValueError(f"on_divergence must be one of {POLICIES}, got {self.policy!r}")

    @property
    def on(self) -> bool:
        """Whether this member compares at all."""
        return bool(self.interval)

    @property
    def advertised(self) -> tuple[int, int]:
        """``(interval, policy code)`` as a slot's header carries them (0: off)."""
        return (self.interval or 0, POLICIES.index(self.policy) + 1)


# -- the settings a group advertises in its replica id ---------------------------------------
#
# A Manager registers as ``{name}:{uuid}`` with a fresh uuid at every start. Its uuid is a
# version 8 (custom) uuid carrying the settings in fixed fields; the rest stays random, so the
# id is as unique as before. A reference group's id is a version 4 uuid and never decodes:
#
#   bits 80-127 random | 76-79 version 8 | 64-75 tag | 62-63 variant | 52-61 format (10 bits) |
#   48-51 policy code | 16-47 interval | 0-15 random

_TAG = 0xD17
_INTERVAL_BITS = 32
_RANDOM = ((1 << 48) - 1) << 80 | 0xFFFF


def advertise(settings: GuardSettings, random: int) -> str:
    """The uuid part of a Manager's replica id, carrying ``settings`` and :data:`FORMAT`.

    Args:
        settings: this group's settings (validated).
        random: random bits (``uuid.uuid4().int``); 64 of them are kept.
    """
    interval, policy = settings.advertised
    value = (
        (random & _RANDOM)
        | 8 << 76
        | _TAG << 64
        | 0b10 << 62
        | FORMAT << 52
        | policy << 48
        | interval << 16
    )
    h = f"{value:032x}"
    return f"{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"


def advertised(replica_id: str) -> tuple[int, GuardSettings] | None:
    """``(format, settings)`` a replica id advertises, or None (a reference group's, a name).

    Args:
        replica_id: a quorum member's replica id (``{name}:{uuid}``, or a uuid alone).
    """
    digits = replica_id.rpartition(":")[2]
    if [len(part) for part in digits.split("-")] != [8, 4, 4, 4, 12]:
        return None
    try:
        value = int(digits.replace("-", ""), 16)
    except ValueError:
        return None
    if value >> 76 & 0xF != 8 or value >> 64 & 0xFFF != _TAG or value >> 62 & 0b11 != 0b10:
        return None
    policy = value >> 48 & 0xF
    if not 1 <= policy <= len(POLICIES):
        return None
    interval = value >> 16 & ((1 << _INTERVAL_BITS) - 1)
    return value >> 52 & 0x3FF, GuardSettings(interval, POLICIES[policy - 1])


def agreed(replica_ids: list[str]) -> GuardSettings | None:
    """The settings every participant of a quorum advertises, when they are the same, in this
    format, and on; None otherwise (then nobody compares: nothing hangs).

    Args:
        replica_ids: the quorum's participants (every rank of every group receives the same).
    """
    seen = {advertised(r) for r in replica_ids}
    if len(seen) != 1:
        return None  # none, or other settings, or a group that advertises nothing
    only = seen.pop()
    if only is None or only[0] != FORMAT or not only[1].on:
        return None
    return only[1]


def name_hash(name: str) -> int:
    """A stable 64-bit hash of a name (FNV-1a: the same on every host, unlike ``hash``)."""
    value = 0xCBF29CE484222325
    for byte in name.encode():
        value = ((value ^ byte) * 0x100000001B3) & _MASK
    return value


def combine(parts: list[tuple[int, int]], seed: int) -> tuple[int, int]:
    """One digest of several (sum, weighted sum) pairs, modulo 2**64.

    Each pair is multiplied by an odd number, so a change of ``2**k`` in any part stays a
    non-zero change of the result: a single flipped bit is never hidden.

    Args:
        parts: the parts' digests, in a fixed order.
        seed: mixed in (a name hash), so equal parts under other names differ.
    """
    total, weighted = seed & _MASK, (seed * 3) & _MASK
    for index, (s, w) in enumerate(parts):
        odd = 2 * index + 1
        total = (total + odd * s) & _MASK
        weighted = (weighted + odd * w) & _MASK
    return total, weighted


def slot_words() -> int:
    """Words per member in the exchanged vector."""
    return HEADER + 3 * MAX_KEYS


@dataclass(frozen=True)
class Slot:
    """One member's part of an exchange, decoded.

    Args:
        rank: its participating rank (its index in the process group).
        interval: the interval it advertises (0: its guard is off).
        policy: its policy code (1-based index into :data:`POLICIES`).
        step: its step.
        eligible: it sent a fingerprint.
        last_heal: the step of its last heal (-1: never healed).
        entries: ``(name hash, sum, weighted sum)`` per key.
        tensors: how many tensors its fingerprint covers.
    """

    rank: int
    interval: int
    policy: int
    step: int
    eligible: bool
    last_heal: int
    entries: tuple[tuple[int, int, int], ...] = ()
    tensors: int = 0


def encode(slot: Slot) -> list[int]:
    """A member's words (unsigned 64-bit values; the shell writes them at its rank's offset).

    Keys beyond :data:`MAX_KEYS` are folded into the last entry by the caller.
    """
    words = [
        1,
        slot.interval,
        slot.policy,
        slot.step,
        int(slot.eligible),
        slot.last_heal + 1,
        len(slot.entries),
        slot.tensors,
    ]
    for entry in slot.entries[:MAX_KEYS]:
        words.extend(value & _MASK for value in entry)
    words.extend([0] * (slot_words() - len(words)))
    return words


def decode(words: list[int], world: int) -> list[Slot | None]:
    """The members' slots from the summed vector (None: a member wrote nothing).

    Args:
        words: the vector after the exchange, as unsigned 64-bit values.
        world: members in the process group.
    """
    size = slot_words()
    slots: list[Slot | None] = []
    for rank in range(world):
        w = [value & _MASK for value in words[rank * size : (rank + 1) * size]]
        if not w or w[0] != 1:
            slots.append(None)
            continue
        keys = min(w[6], MAX_KEYS)
        entries = tuple(
            (w[HEADER + 3 * i], w[HEADER + 3 * i + 1], w[HEADER + 3 * i + 2]) for i in range(keys)
        )
        slots.append(Slot(rank, w[1], w[2], w[3], bool(w[4]), w[5] - 1, entries, w[7]))
    return slots


@dataclass
class Schedule:
    """When this rank exchanges fingerprints (one per rank, advanced on the training thread).

    Its state changes only with what every member of a quorum sees alike (the quorum, its step,
    whether someone heals, the advertised settings), never with how a member's own exchange
    went: so every member of a quorum holds the same state and decides alike.
    """

    #: The quorum whose first step without a heal was compared (-1: none yet).
    quorum_id: int = -1
    #: Someone healed in a step not compared since.
    after_heal: bool = False

    def due(
        self, *, quorum_id: int, step: int, heals: bool, settings: GuardSettings | None
    ) -> str | None:
        """Why an exchange runs this step, or None. Call once per step.

        Args:
            quorum_id: the step's quorum.
            step: the quorum's step (every member is at it when it votes).
            heals: someone heals in this step (every member knows it from the quorum: fewer
                members are at its step than are in it, or it is step 0).
            settings: the settings every participant advertised (:func:`agreed`); None: they
                differ, or someone advertises none, or the guard is off: no exchange at all.
        """
        if settings is None:
            return None
        if heals:
            # The healer receives beside the step's collectives: nobody waits for it in one.
            self.after_heal = True
            return None
        reason = None
        interval = settings.interval or 0
        if quorum_id != self.quorum_id:
            reason = "quorum"
        elif self.after_heal:
            reason = "heal"
        elif interval and step % interval == 0:
            reason = "interval"
        if reason is not None:
            self.quorum_id, self.after_heal = quorum_id, False
        return reason


def verdict_awaited(*, then_quorum_id: int, now_quorum_id: int, ended: bool) -> bool:
    """Whether a rank waits for the verdict of the exchange it started in quorum ``then``, at
    its next check in quorum ``now``.

    Within a quorum, always: every member sent its part and the sum comes. Once the quorum is
    gone, only if the sum is already in: a member left out may be frozen with its part unsent,
    its connections alive (nothing cuts them), and the wait would last the collective's whole
    timeout. Nothing is lost: a new quorum compares at its first step.
    """
    return ended or now_quorum_id == then_quorum_id


@dataclass(frozen=True)
class Verdict:
    """What an exchange showed.

    Args:
        step: the step compared.
        compared: the participating ranks whose fingerprints were compared.
        reference: the ranks of the reference class (the majority, or the tie rule's pick).
        repair: the ranks outside it.
        differing: per rank outside it, the indices of its entries (keys) that differ from
            the reference.
        rule: how the reference was chosen, in words.
    """

    step: int
    compared: tuple[int, ...]
    reference: tuple[int, ...] = ()
    repair: tuple[int, ...] = ()
    differing: dict[int, tuple[int, ...]] = field(default_factory=dict)
    rule: str = ""

    @property
    def matched(self) -> bool:
        """Every compared member holds the same state."""
        return not self.repair


def judge(slots: list[Slot | None], step: int) -> Verdict:
    """The verdict of one exchange (the same on every member: a function of the words alone).

    Args:
        slots: the decoded slots.
        step: the quorum's step.
    """
    compared = [s for s in slots if s is not None and s.eligible and s.step == step]
    classes: dict[tuple[tuple[int, int, int], ...], list[Slot]] = {}
    for slot in compared:
        classes.setdefault(slot.entries, []).append(slot)
    ranks = tuple(s.rank for s in compared)
    if len(classes) <= 1:
        return Verdict(step=step, compared=ranks)

    def order(members: list[Slot]) -> tuple[int, int, int]:
        return (-len(members), min(m.last_heal for m in members), min(m.rank for m in members))

    ranked = sorted(classes.values(), key=order)
    best, runner_up = ranked[0], ranked[1]
    if len(best) > len(runner_up):
        rule = "majority"
    elif min(m.last_heal for m in best) < min(m.last_heal for m in runner_up):
        rule = "no majority: the groups that healed most recently yield"
    else:
        rule = "no majority: the higher participating ranks yield"
    reference = best[0]
    repair = tuple(sorted(s.rank for s in compared if s.entries != reference.entries))
    differing = {}
    for slot in compared:
        if slot.entries == reference.entries:
            continue
        count = max(len(slot.entries), len(reference.entries))
        differing[slot.rank] = tuple(
            i
            for i in range(count)
            if i >= len(slot.entries)
            or i >= len(reference.entries)
            or slot.entries[i] != reference.entries[i]
        )
    return Verdict(
        step=step,
        compared=ranks,
        reference=tuple(sorted(m.rank for m in best)),
        repair=repair,
        differing=differing,
        rule=rule,
    )


# -- which tensors differ (a second exchange, after a mismatch only) -------------------------
#
# Every member judged the same words, so every member knows a mismatch was found and how many
# tensors the largest fingerprint covered: they all run the second exchange, of that size.
# Each member writes its tensors' (sum, weighted sum) in its own region, zeros elsewhere.


def tensor_count(slots: list[Slot | None]) -> int:
    """Tensors per member in the second exchange (the most any compared member covered)."""
    counts = [s.tensors for s in slots if s is not None and s.eligible]
    return min(max(counts, default=0), MAX_TENSORS)


def tensor_words(digests: list[tuple[int, int]], count: int) -> list[int]:
    """A member's region of the second exchange (unsigned 64-bit values).

    Args:
        digests: its tensors' ``(sum, weighted sum)``, in its fingerprint's order.
        count: :func:`tensor_count`.
    """
    words = [value & _MASK for pair in digests[:count] for value in pair]
    return words + [0] * (2 * count - len(words))


def differing_tensors(words: list[int], count: int, verdict: Verdict) -> dict[int, tuple[int, ...]]:
    """Per member outside the reference, the indices of its tensors that differ from the
    reference's first member.

    Args:
        words: the second exchange's vector (every member's region, in rank order).
        count: :func:`tensor_count`.
        verdict: the first exchange's verdict.
    """
    if not verdict.reference or count == 0:
        return {}

    def region(rank: int) -> list[int]:
        return [w & _MASK for w in words[rank * 2 * count : (rank + 1) * 2 * count]]

    reference = region(verdict.reference[0])
    out = {}
    for rank in verdict.repair:
        mine = region(rank)
        out[rank] = tuple(
            i for i in range(count) if mine[2 * i : 2 * i + 2] != reference[2 * i : 2 * i + 2]
        )
    return out
