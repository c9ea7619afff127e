"""The learning setting of a run on a policy store: the options a user gave, merged with the
setting the store records (docs/lifecycle.md, "Continue means the same learner").

A store that records a setting (:mod:`rmm_jax.persist.policy_setting`) is continued with it:
the options the user gave explicitly go on top of the recorded fields, the ones left out
keep the recorded values (not the preset's defaults), and what the result changes in the
record is listed, for the caller to refuse or to record (``--change-setting``).
"""
from __future__ import annotations

from typing import NamedTuple

from rmm_jax.core import checks
from rmm_jax.core import config as settings
from rmm_jax.core.config import Setting, same_preset, setting_changes, setting_record, setting_values
from rmm_jax.errors import InputError

__all__ = ["SETTING_OPTIONS", "LearningSetting", "SettingOptions", "blamed_change", "resolve_setting"]

# the options that set fields of the record, the preset first (the layout's shape is not recorded)
SETTING_OPTIONS = ("preset", "batch", "tau", "lr", "reward", "baseline", "credit", "loss", "clip", "p_useful",
                   "p_other", "draw_tau", "offset")


class SettingOptions(NamedTuple):
    """The learning options of a run, each None where the user left it to the preset
    (``preset``: the preset's name; ``scope`` None: user; ``hidden``: the `mlp` kind's
    width; ``clip``: the importance-ratio ceiling of a verb that has one).

    Examples:
        >>> from rmm_jax.online.setting import SettingOptions
        >>> SettingOptions("default", 8, 3, kind="linear", lr=2e-4).lr
        0.0002
    """
    preset: str
    k: int | None
    m: int | None
    batch: int | None = None
    tau: float | None = None
    lr: float | None = None
    reward: str | None = None
    baseline: str | None = None
    credit: str | None = None
    kind: str | None = None
    scope: str | None = None
    rank: int | None = None
    hidden: int | None = None
    loss: str | None = None
    clip: float | None = None
    p_useful: float | None = None
    p_other: float | None = None
    draw_tau: float | None = None
    offset: float | None = None

    @classmethod
    def of(cls, options: dict) -> SettingOptions:
        """The fields of ``options`` (a verb's parsed options, by parameter name) that are
        setting options; the others are not read, the ones it lacks are None."""
        return cls(**{f: options.get(f) for f in cls._fields})


class LearningSetting(NamedTuple):
    """A run's :class:`Setting`, its preset's name, what the policy store records (None: no
    record yet) and the ``(field, recorded, new)`` changes this run makes to the record."""
    setting: Setting
    preset: str
    recorded: dict | None
    changes: list

    @property
    def record(self) -> dict:
        return setting_record(self.preset, self.setting)

    @property
    def to_record(self) -> bool:
        """Whether the run records its setting: a store without one, or a change."""
        return self.recorded is None or bool(self.changes)


def resolve_setting(recorded: dict, given: SettingOptions, explicit) -> LearningSetting:
    """The setting of a run on a store that records ``recorded``: the recorded fields with
    the options in ``explicit`` (names of the fields the user gave) from ``given`` on top.
    An explicit ``preset`` is taken as it is now (a store recorded under an older `default`
    moves to today's); left out, the recorded preset's name and fields are kept. The
    layout's shape (k, m, kind, scope, rank) is ``given``'s; ``kind`` or ``hidden`` None:
    the preset's. ``recorded`` None (a store that records no setting yet): the preset
    ``given.preset`` with every field ``given`` sets. A bad value raises the core's
    ``ValueError("field: message")``; ``given`` other than a :class:`SettingOptions` (the old
    dict) or ``explicit`` a str rather than a set of names, an ``InputError`` naming it.

    Examples:
        >>> from rmm_jax import preset
        >>> from rmm_jax.core.config import setting_record
        >>> from rmm_jax.online.setting import SettingOptions, resolve_setting
        >>> recorded = setting_record("reinforce", preset("reinforce"))
        >>> given = SettingOptions("default", 8, 3, kind="linear", lr=2e-4)
        >>> ls = resolve_setting(recorded, given, {"lr"})
        >>> ls.preset, ls.setting.estimator.loss, ls.changes
        ('reinforce', 'reinforce', [('lr', 0.0003, 0.0002)])
    """
    if not isinstance(given, SettingOptions):
        raise InputError(f"must be a SettingOptions (SettingOptions.of(options) for a dict), got {checks.short(given)}",
                         arg="given")
    if isinstance(explicit, (str, bytes)):
        raise InputError(f"must be a set of field names ({{{explicit!r}}} for one), got {explicit!r}", arg="explicit")
    explicit = set(explicit)
    if recorded is None:   # no record yet: the preset with every option given
        explicit |= {"preset"} | {f for f in SETTING_OPTIONS if getattr(given, f) is not None}
    name = given.preset if "preset" in explicit else recorded.get("preset", given.preset)
    # --preset given: that preset as it is now; left out: the recorded fields
    values = setting_values(recorded) if "preset" not in explicit and name == recorded.get("preset") else {}
    values.pop("preset", None)
    values.update({f: getattr(given, f) for f in SETTING_OPTIONS[1:] if f in explicit})
    shape = {f: getattr(given, f) for f in ("kind", "hidden") if getattr(given, f) is not None}
    setting = settings.preset(name, k=given.k, m=given.m, scope=given.scope or "user", rank=given.rank, **shape,
                              **values)
    if recorded is None:
        return LearningSetting(setting, name, None, [])
    return LearningSetting(setting, name, recorded, setting_changes(recorded, setting_record(name, setting)))


def shown_value(field: str, value) -> object:
    """A recorded setting value as a message shows it: a None that is a value (``draw_tau``:
    the draw at the loss's τ) in words, any other value as it is.

    Examples:
        >>> from rmm_jax.online.setting import shown_value
        >>> shown_value("draw_tau", None), shown_value("lr", 1e-4)
        ("none (the loss's tau)", 0.0001)
    """
    return "none (the loss's tau)" if field == "draw_tau" and value is None else value


def blamed_change(ls: LearningSetting, explicit) -> tuple[str, object, str]:
    """For a run whose setting ``ls`` changes its store's record: the option to name (the
    first changed field the user gave, else ``preset``), its value as shown, and what the
    store records instead, in words.

    Examples:
        >>> from rmm_jax import preset
        >>> from rmm_jax.core.config import setting_record
        >>> from rmm_jax.online.setting import SettingOptions, blamed_change, resolve_setting
        >>> recorded = setting_record("reinforce", preset("reinforce"))
        >>> given = SettingOptions("default", 8, 3, kind="linear", lr=2e-4)
        >>> blamed_change(resolve_setting(recorded, given, {"lr"}), {"lr"})
        ('lr', 0.0002, 'lr 0.0003')
    """
    name, recorded = ls.preset, ls.recorded
    field, old, new = ls.changes[0]
    option = field if "preset" not in explicit or field in explicit else "preset"
    shown = name if option == "preset" else new
    if option == "preset" and same_preset(name, recorded.get("preset")):   # one preset, defined otherwise now
        was = f"preset {recorded.get('preset')} as it was then: " + ", ".join(f"{f} {shown_value(f, a)}"
                                                                             for f, a, _ in ls.changes)
    else:
        others = [f for f, _, _ in ls.changes if f != option]
        was = (f"{option} {recorded.get('preset') if option == 'preset' else shown_value(field, old)}"
               + (f"; {', '.join(others)} change with it" if others else ""))
    return option, shown, was
