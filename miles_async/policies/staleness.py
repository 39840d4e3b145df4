"""The one staleness formula of the RL loop: admission control, the buffer and the simulator all call it.

Versions. The trainer's version `v` is the version of the weights the next (or current) batch is
trained at; it goes up by one per optimizer step. An engine's version `e` is the version of the
weights it generates with (`e <= v`: engines only ever receive weights the trainer made). A sample
records the engine version of every engine call it made (`versions`, several when a partial
rollout spans a weight update, or for a multi-turn agent).

Staleness of a group (the n samples of one prompt) trained at version `v`:

    staleness = v - min(every version of every sample in the group)

The buffer rejects a group whose staleness exceeds `max_staleness` when it is drawn for a batch.
`max_staleness = 0` is synchronous (generate, then train, in lockstep: on-policy); 1 is
one-step-off; k > 1 is fully asynchronous.

Admission. A group admitted now is generated at engine version >= `e` (the oldest live engine)
and is trained no earlier than after every group already pending before it. With `B` groups per
step and `q` groups pending (admitted and neither trained nor dropped: generating, in the buffer,
or in the batch the trainer is training at `v`), the new group is the `q`-th in line, so it is
trained at version `t = v + q // B` and its staleness is at most `t - e`. It may start only if
`t - e <= max_staleness`, that is while

    q < (e + max_staleness - v + 1) * B

(AReaL's rule, counted from the trainer's current step instead of from version 0, so it holds
after a resume and after dropped groups.) Worked example, B = 2 groups per step, max_staleness 1:

    v = 3, e = 3, q = 0..3  ->  admitted (t = 3 or 4, staleness <= 1)
    v = 3, e = 3, q = 4     ->  waits: it would be trained at 5, two versions after 3
    v = 4, e = 3, q = 2     ->  waits (capacity (3+1-4+1)*2 = 2) until the engines get version 4
    a sample with versions [3, 4] in a group trained at v = 5 has staleness 5 - 3 = 2 > 1: stale.

The bound assumes groups are trained in the order admitted; one overtaken by later groups (they
finish out of order) can still go stale, which is why the buffer applies the same formula when it
draws a batch. Sync mode (max_staleness 0, v = e = 0): exactly B groups are admitted; none more until the trainer
has trained them (v = 1) and the engines hold version 1.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence


def sample_staleness(versions: Sequence[int], trainer_version: int) -> int:
    """How many versions the oldest engine call of one sample lags `trainer_version`."""
    if not versions:
        raise ValueError("a sample needs at least one recorded engine version to have a staleness; "
                         "record the engine's weight version with every engine call")
    oldest = min(versions)
    if oldest < 0 or oldest > trainer_version:
        raise ValueError(f"sample version {oldest} is outside 0..trainer_version={trainer_version}: "
                         "an engine can only hold weights the trainer already made")
    return trainer_version - oldest


def group_staleness(versions_per_sample: Iterable[Sequence[int]], trainer_version: int) -> int:
    """`trainer_version - min(all versions of all samples)`: the group is as stale as its oldest call."""
    staleness = [sample_staleness(v, trainer_version) for v in versions_per_sample]
    if not staleness:
        raise ValueError("a group needs at least one sample to have a staleness")
    return max(staleness)


def is_stale(staleness: int, max_staleness: int) -> bool:
    return staleness > max_staleness


def admission_capacity(trainer_version: int, policy_version: int, max_staleness: int, *,
                       batch_groups: int, num_pending_groups: int) -> int:
    """How many more groups may be admitted now (0 when none): `(e + k - v + 1) * B - q`."""
    _check_admission_args(trainer_version, policy_version, max_staleness, batch_groups, num_pending_groups)
    allowed = (policy_version + max_staleness - trainer_version + 1) * batch_groups
    return max(0, allowed - num_pending_groups)


def admissible(trainer_version: int, policy_version: int, max_staleness: int, *,
               batch_groups: int, num_pending_groups: int) -> bool:
    """Whether one more group, generated now at engine version `policy_version`, may start.

    `num_pending_groups`: groups admitted and neither trained nor dropped (in flight + buffered +
    in the batch being trained at `trainer_version`). See the module docstring for the formula.
    """
    return admission_capacity(trainer_version, policy_version, max_staleness, batch_groups=batch_groups,
                              num_pending_groups=num_pending_groups) > 0


def trained_at_version(trainer_version: int, *, batch_groups: int, position: int) -> int:
    """The version at which the group `position`-th in line (0-based) will be trained, at the earliest."""
    if batch_groups < 1 or position < 0:
        raise ValueError(f"need batch_groups >= 1 and position >= 0, got {batch_groups} and {position}")
    return trainer_version + position // batch_groups


def _check_admission_args(trainer_version: int, policy_version: int, max_staleness: int, batch_groups: int,
                          num_pending_groups: int) -> None:
    if max_staleness < 0:
        raise ValueError(f"max_staleness must be >= 0 (0 is synchronous), got {max_staleness}")
    if batch_groups < 1:
        raise ValueError(f"batch_groups must be >= 1, got {batch_groups}")
    if num_pending_groups < 0:
        raise ValueError(f"num_pending_groups must be >= 0, got {num_pending_groups}")
    if not 0 <= policy_version <= trainer_version:
        raise ValueError(f"need 0 <= policy_version <= trainer_version, got engine version {policy_version} "
                         f"and trainer version {trainer_version}: engines only hold weights the trainer made")
