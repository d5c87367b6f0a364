"""Which health events make a device unhealthy, and for how long: a pure policy (no NVML, no I/O).

Inputs: NVIDIA's defaults, NVIDIA's two environment variables, and the user's per-XID action table
from the config file. Output: a `HealthAction` per XID and per ECC event kind.

Actions
-------
- `ignore`: the event changes nothing.
- `transient`: the device is unhealthy, and healthy again once no new event came for the quiet
  period AND a health probe passed after the last event.
- `until-reset`: the device is unhealthy until the GPU is reset, or re-appears after being lost.

NVIDIA v0.20.0 semantics of the environment variables (read from its `internal/rm/health.go`
and its tests), and what gpuvisor does
------------------------------------------------------------------------------------------------
Both values are lower-cased, split on commas and trimmed; empty items are skipped; items that
are not a non-negative integer are skipped with a log line (gpuvisor: same, listed in
`HealthPolicy.warnings`; it also skips `0`, which is no XID).

- Default ignored XIDs: 13, 31, 43, 45, 68, 109 (application errors). gpuvisor: those, and the
  XIDs whose catalog action keeps the GPU in service (63, 92, 94, 154; see the table).
- `DP_DISABLE_HEALTHCHECKS=all` or `=xids` (either anywhere in the list): no health checks at all;
  `xids` is a plain alias of `all` in NVIDIA's code. gpuvisor: `checks_enabled` is False and
  every event is ignored.
- `DP_DISABLE_HEALTHCHECKS=<list>`: those XIDs are ignored in addition to the defaults.
- `DP_ENABLE_HEALTHCHECKS=<list>`: those XIDs count even if ignored by default or by the disable
  list (enable wins). gpuvisor: also wins over an `ignore` in the user table.
- `DP_ENABLE_HEALTHCHECKS=all` (or `xids`): every XID counts, the default-ignored ones too, even
  with `DP_DISABLE_HEALTHCHECKS=all`.
- `DP_DISABLE_HEALTHCHECKS=all` with `DP_ENABLE_HEALTHCHECKS=<list>`: NVIDIA documents that this
  selects just those XIDs, but its code returns before any check runs, so nothing is checked.
  gpuvisor follows the documented intent: only the listed XIDs count, nothing else (no ECC).
- ECC events: NVIDIA registers single- and double-bit ECC events but skips every event that is
  not an XID, so neither takes a device out by itself (a DBE also raises XID 48, which does).
  gpuvisor: a double-bit ECC event is `until-reset` (the same condition XID 48 would set); a
  single-bit one is `ignore` (the hardware corrected it; a high SBE rate comes as XID 92).

An XID that counts takes its action from, in order: the user table (a non-`ignore` entry), the
default table below, else the unknown-XID action. An XID enabled by `DP_ENABLE_HEALTHCHECKS`
whose table entry is `ignore` takes the unknown-XID action.

Unknown XIDs (in no table and not ignored): `until-reset` by default. NVIDIA marks the device
unhealthy for good; gpuvisor keeps that severity, because an XID nobody classified may well be a
hardware fault and a probe cannot prove otherwise, but a reset or re-appearance recovers it.
The config can map any XID, and `unknown_action` changes the fallback.

Default table
-------------
From NVIDIA's XID documentation: docs.nvidia.com/deploy/xid-errors, its Xid catalog for Ampere
and newer ("catalog bucket" is the catalog's "Resolution Bucket (Immediate Action)"; the
spreadsheet is the authority, re-check against it when the table changes), and the dynamic page
retirement and A100 memory error management guides. An XID whose immediate action keeps the GPU
in service (IGNORE: no action; RESTART_APP: restart the application, no reset needed) takes no
device out; its log line is a warning when the catalog advises something (a reset when
convenient, support). One needing a reset or a reboot is `until-reset`. NVIDIA's default-ignored
XIDs stay ignored whatever their bucket, so a drop-in gpuvisor takes out no GPU NVIDIA's plugin
keeps; `DP_ENABLE_HEALTHCHECKS=109` gives 109 the unknown-XID action, the catalog's reset.
Generated from DEFAULT_XID_RULES by `xid_table_markdown()`:

| XID | meaning | catalog bucket | gpuvisor | why |
| --- | --- | --- | --- | --- |
| 13 | Graphics engine exception | RESTART_APP | ignore | an application error: the application restarts, the GPU is fine; NVIDIA default-ignored |
| 31 | GPU memory page fault | RESTART_APP | ignore | an application error: the application restarts, the GPU is fine; NVIDIA default-ignored |
| 43 | GPU stopped processing | IGNORE | ignore | the GPU remains in a healthy state (catalog); NVIDIA default-ignored |
| 45 | Preemptive cleanup, due to previous errors | WORKFLOW_XID_45 | ignore | alone: restart Fabric Manager; with other XIDs: follow those (catalog); NVIDIA default-ignored |
| 48 | Double-bit ECC error | WORKFLOW_XID_48 | until-reset | uncorrectable memory error; a GPU reset or node reboot is needed to clear it (catalog); with XID 63 or 64, drain and reset |
| 63 | ECC page retirement or row remapping recorded | IGNORE | ignore | the bad memory is isolated; NVIDIA's A100 memory guide: unaffected applications continue and new work can launch; the retirement or remap waits for the next reset |
| 64 | ECC page retirement or row remapping failure | RESET_GPU | until-reset | the bad memory could not be isolated; reset, likely RMA |
| 68 | Video processor exception | RESTART_APP | ignore | an application error: the application restarts, the GPU is fine; NVIDIA default-ignored |
| 74 | NVLink error | WORKFLOW_NVLINK_ERR | until-reset | a GPU reset or node reboot is needed to clear it (catalog) |
| 79 | GPU has fallen off the bus | RESTART_BM | until-reset | GPU unreachable: reboot the node; also reported as lost, recovers when NVML sees it again |
| 92 | High single-bit ECC error rate | IGNORE | ignore | the errors were corrected; the catalog's follow-up is to contact support, not to stop work |
| 94 | Contained ECC error | RESTART_APP | ignore | only the application that hit the bad memory is affected; other and new work run on, and a reset can wait until convenient (catalog) |
| 95 | Uncontained ECC error | RESET_GPU | until-reset | every application on the GPU is affected; the GPU must be reset before applications can restart |
| 109 | Context switch timeout | RESET_GPU | ignore | NVIDIA default-ignored, kept for drop-in compatibility; `DP_ENABLE_HEALTHCHECKS=109` (or `xids: {"109": until-reset}`) takes the GPU out until a reset, as the catalog asks |
| 119 | GSP RPC timeout | RESET_GPU | until-reset | the GPU System Processor stopped answering |
| 120 | GSP error | RESET_GPU | until-reset | GSP firmware fault |
| 154 | GPU recovery action changed | XID_154 | ignore | tells what another XID calls for, and that XID carries its own action; as an unknown XID (until-reset) it would take a GPU out even when the new action is none |
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum

from supervisor.config import Config

DISABLE_ENV = "DP_DISABLE_HEALTHCHECKS"
ENABLE_ENV = "DP_ENABLE_HEALTHCHECKS"

DEFAULT_QUIET_SECONDS = 60.0
# The settings the policy is made of: a reload that changes none of them keeps the policy.
HEALTH_SETTINGS = ("disable_healthchecks", "enable_healthchecks", "health")


class PolicyError(ValueError):
    """A health policy setting is invalid; the text names the setting, the value and the reason."""


class HealthAction(StrEnum):
    IGNORE = "ignore"
    TRANSIENT = "transient"
    UNTIL_RESET = "until-reset"


class EccKind(StrEnum):
    SINGLE_BIT = "single-bit"
    DOUBLE_BIT = "double-bit"


@dataclass(frozen=True)
class XidRule:
    action: HealthAction
    reason: str  # what the XID means, in device health reasons and log lines
    bucket: str = ""  # the catalog's "Resolution Bucket (Immediate Action)"
    why: str = ""  # why the default action is what it is (the tables' last column)
    advice: str = ""  # what an operator should do about an XID that keeps the GPU in service


# NVIDIA v0.20.0 ignores these by default (application errors).
NVIDIA_IGNORED_XIDS: frozenset[int] = frozenset({13, 31, 43, 45, 68, 109})

_APP_ERROR = "an application error: the application restarts, the GPU is fine; NVIDIA default-ignored"
_RESET_NEEDED = "a GPU reset or node reboot is needed to clear it (catalog)"

# The one declaration of the default table: docs/health.md's and the module docstring's copies are
# `xid_table_markdown()`, which tests/packaging/test_readme.py holds them to. An XID whose catalog
# action keeps the GPU in service (IGNORE, RESTART_APP) is ignored, with its advice in its log
# line; a reset or a reboot is until-reset; NVIDIA's default-ignored XIDs stay ignored, so
# gpuvisor takes out no GPU that NVIDIA's plugin would keep (its env vars are NVIDIA's too).
DEFAULT_XID_RULES: Mapping[int, XidRule] = {
    13: XidRule(HealthAction.IGNORE, "graphics engine exception", "RESTART_APP", _APP_ERROR),
    31: XidRule(HealthAction.IGNORE, "GPU memory page fault", "RESTART_APP", _APP_ERROR),
    43: XidRule(
        HealthAction.IGNORE,
        "GPU stopped processing",
        "IGNORE",
        "the GPU remains in a healthy state (catalog); NVIDIA default-ignored",
    ),
    45: XidRule(
        HealthAction.IGNORE,
        "preemptive cleanup, due to previous errors",
        "WORKFLOW_XID_45",
        "alone: restart Fabric Manager; with other XIDs: follow those (catalog); NVIDIA default-ignored",
    ),
    48: XidRule(
        HealthAction.UNTIL_RESET,
        "double-bit ECC error",
        "WORKFLOW_XID_48",
        "uncorrectable memory error; " + _RESET_NEEDED + "; with XID 63 or 64, drain and reset",
    ),
    63: XidRule(
        HealthAction.IGNORE,
        "ECC page retirement or row remapping recorded",
        "IGNORE",
        "the bad memory is isolated; NVIDIA's A100 memory guide: unaffected applications continue "
        "and new work can launch; the retirement or remap waits for the next reset",
        "the retirement or remap takes effect at the next reset; reset the GPU when convenient",
    ),
    64: XidRule(
        HealthAction.UNTIL_RESET,
        "ECC page retirement or row remapping failure",
        "RESET_GPU",
        "the bad memory could not be isolated; reset, likely RMA",
    ),
    68: XidRule(HealthAction.IGNORE, "video processor exception", "RESTART_APP", _APP_ERROR),
    74: XidRule(HealthAction.UNTIL_RESET, "NVLink error", "WORKFLOW_NVLINK_ERR", _RESET_NEEDED),
    79: XidRule(
        HealthAction.UNTIL_RESET,
        "GPU has fallen off the bus",
        "RESTART_BM",
        "GPU unreachable: reboot the node; also reported as lost, recovers when NVML sees it again",
    ),
    92: XidRule(
        HealthAction.IGNORE,
        "high single-bit ECC error rate",
        "IGNORE",
        "the errors were corrected; the catalog's follow-up is to contact support, not to stop work",
        "the errors were corrected; contact NVIDIA support if the rate persists",
    ),
    94: XidRule(
        HealthAction.IGNORE,
        "contained ECC error",
        "RESTART_APP",
        "only the application that hit the bad memory is affected; other and new work run on, and "
        "a reset can wait until convenient (catalog)",
        "the application that hit it must restart; reset the GPU when convenient",
    ),
    95: XidRule(
        HealthAction.UNTIL_RESET,
        "uncontained ECC error",
        "RESET_GPU",
        "every application on the GPU is affected; the GPU must be reset before applications can restart",
    ),
    109: XidRule(
        HealthAction.IGNORE,
        "context switch timeout",
        "RESET_GPU",
        "NVIDIA default-ignored, kept for drop-in compatibility; `DP_ENABLE_HEALTHCHECKS=109` "
        '(or `xids: {"109": until-reset}`) takes the GPU out until a reset, as the catalog asks',
        "as NVIDIA's plugin does; the catalog advises a GPU reset "
        "(DP_ENABLE_HEALTHCHECKS=109 takes the GPU out until one)",
    ),
    119: XidRule(
        HealthAction.UNTIL_RESET, "GSP RPC timeout", "RESET_GPU", "the GPU System Processor stopped answering"
    ),
    120: XidRule(HealthAction.UNTIL_RESET, "GSP error", "RESET_GPU", "GSP firmware fault"),
    154: XidRule(
        HealthAction.IGNORE,
        "GPU recovery action changed",
        "XID_154",
        "tells what another XID calls for, and that XID carries its own action; as an unknown XID "
        "(until-reset) it would take a GPU out even when the new action is none",
        "the XID it reports on carries its own action; nvidia-smi -q shows the recovery action",
    ),
}


def xid_table_markdown() -> str:
    """The default XID table as docs/health.md and this module's docstring show it."""
    rows = ["| XID | meaning | catalog bucket | gpuvisor | why |", "| --- | --- | --- | --- | --- |"]
    for xid, rule in sorted(DEFAULT_XID_RULES.items()):
        meaning = rule.reason[0].upper() + rule.reason[1:]
        rows.append(f"| {xid} | {meaning} | {rule.bucket} | {rule.action.value} | {rule.why} |")
    return "\n".join(rows)


_ECC_DEFAULTS: Mapping[EccKind, HealthAction] = {
    EccKind.SINGLE_BIT: HealthAction.IGNORE,
    EccKind.DOUBLE_BIT: HealthAction.UNTIL_RESET,
}


@dataclass(frozen=True)
class _EnvList:
    """One parsed DP_* value: `all` (or `xids`), or a set of XIDs."""

    everything: bool
    xids: frozenset[int]
    warnings: tuple[str, ...]


def _parse_env(name: str, value: str | None) -> _EnvList:
    if value is None:
        return _EnvList(False, frozenset(), ())
    xids: set[int] = set()
    warnings: list[str] = []
    for item in value.lower().split(","):
        text = item.strip()
        if text in ("all", "xids"):
            # As NVIDIA: `all`/`xids` anywhere makes the whole value mean everything.
            return _EnvList(True, frozenset(), ())
        if not text:
            continue
        if not (text.isascii() and text.isdigit()) or int(text) == 0:
            warnings.append(f"{name}: ignoring {text!r}: not an XID (a positive integer, 'all' or 'xids')")
            continue
        xids.add(int(text))
    return _EnvList(False, frozenset(xids), tuple(warnings))


def _parse_action(xid: object, value: object) -> HealthAction:
    if isinstance(value, HealthAction):
        return value
    text = str(value).strip().lower() if isinstance(value, str) else None
    for action in HealthAction:
        if text == action.value:
            return action
    allowed = ", ".join(a.value for a in HealthAction)
    raise PolicyError(f"health XID action for XID {xid}: {value!r} is not one of {allowed}")


def _parse_xid_key(key: object) -> int:
    if isinstance(key, bool):
        raise PolicyError(f"health XID action key {key!r} is not an XID (a positive integer)")
    if isinstance(key, int):
        xid = key
    elif isinstance(key, str) and key.strip().isascii() and key.strip().isdigit():
        xid = int(key.strip())
    else:
        raise PolicyError(f"health XID action key {key!r} is not an XID (a positive integer)")
    if xid <= 0:
        raise PolicyError(f"health XID action key {key!r} is not an XID (a positive integer)")
    return xid


@dataclass(frozen=True)
class HealthPolicy:
    """The merged policy. Build it with `from_settings`; ask it with `classify_xid`/`classify_ecc`."""

    checks_enabled: bool = True
    quiet_seconds: float = DEFAULT_QUIET_SECONDS
    rules: Mapping[int, XidRule] = field(default_factory=lambda: dict(DEFAULT_XID_RULES))
    env_ignored: frozenset[int] = frozenset()  # DP_DISABLE_HEALTHCHECKS=<list>
    env_enabled: frozenset[int] = frozenset()  # DP_ENABLE_HEALTHCHECKS=<list>
    enable_all: bool = False  # DP_ENABLE_HEALTHCHECKS=all
    only_enabled: bool = False  # DP_DISABLE_HEALTHCHECKS=all with an enable list
    unknown_action: HealthAction = HealthAction.UNTIL_RESET
    warnings: tuple[str, ...] = ()
    disable_env: str | None = None
    enable_env: str | None = None

    @classmethod
    def from_settings(
        cls,
        disable_env: str | None,
        enable_env: str | None,
        xid_actions: Mapping[int, str] | Mapping[int, HealthAction] | Mapping[str, str],
        quiet_seconds: float,
        *,
        unknown_action: str | HealthAction = HealthAction.UNTIL_RESET,
    ) -> HealthPolicy:
        """Merge defaults, the user's table (xid -> action) and the DP_* env values (None: unset)."""
        if isinstance(quiet_seconds, bool) or not isinstance(quiet_seconds, int | float):
            raise PolicyError(f"health quiet period: {quiet_seconds!r} is not a number of seconds")
        if not math.isfinite(quiet_seconds) or quiet_seconds < 0:
            raise PolicyError(f"health quiet period: {quiet_seconds!r} must be a finite number >= 0")
        fallback = _parse_action("(unknown)", unknown_action)
        if fallback is HealthAction.IGNORE:
            raise PolicyError("health unknown-XID action: 'ignore' would hide every unclassified fault")

        rules: dict[int, XidRule] = dict(DEFAULT_XID_RULES)
        for key, value in xid_actions.items():
            xid = _parse_xid_key(key)
            action = _parse_action(xid, value)
            default = DEFAULT_XID_RULES.get(xid)
            # The XID's meaning and catalog entry stay; only the action is the user's.
            if default is not None:
                rules[xid] = dataclasses.replace(default, action=action)
            else:
                rules[xid] = XidRule(action, "XID not in gpuvisor's table")

        disabled = _parse_env(DISABLE_ENV, disable_env)
        enabled = _parse_env(ENABLE_ENV, enable_env)
        warnings = disabled.warnings + enabled.warnings
        checks_enabled = True
        only_enabled = False
        if disabled.everything and not enabled.everything:
            if enabled.xids:
                only_enabled = True
            else:
                checks_enabled = False
        return cls(
            checks_enabled=checks_enabled,
            quiet_seconds=float(quiet_seconds),
            rules=rules,
            env_ignored=disabled.xids,
            env_enabled=enabled.xids,
            enable_all=enabled.everything,
            only_enabled=only_enabled,
            unknown_action=fallback,
            warnings=warnings,
            disable_env=disable_env,
            enable_env=enable_env,
        )

    @classmethod
    def from_config(cls, config: Config) -> HealthPolicy:
        """The policy a config asks for (`gpuvisor.health`, DP_*_HEALTHCHECKS); raises PolicyError
        for what the policy refuses."""
        return cls.from_settings(
            disable_env=",".join(config.disable_healthchecks) or None,
            enable_env=",".join(config.enable_healthchecks) or None,
            xid_actions=config.health.xid_actions(),
            quiet_seconds=config.health.transient_quiet_seconds,
        )

    def _counted_action(self, xid: int) -> HealthAction:
        """The action for an XID the env vars force to count: never `ignore`."""
        rule = self.rules.get(xid)
        if rule is not None and rule.action is not HealthAction.IGNORE:
            return rule.action
        return self.unknown_action

    def classify_xid(self, xid: int) -> HealthAction:
        if not self.checks_enabled:
            return HealthAction.IGNORE
        if self.only_enabled:
            return self._counted_action(xid) if xid in self.env_enabled else HealthAction.IGNORE
        if self.enable_all or xid in self.env_enabled:
            return self._counted_action(xid)
        if xid in self.env_ignored:
            return HealthAction.IGNORE
        rule = self.rules.get(xid)
        return rule.action if rule is not None else self.unknown_action

    def classify_ecc(self, kind: EccKind | str) -> HealthAction:
        try:
            ecc = EccKind(kind)
        except ValueError:
            allowed = ", ".join(k.value for k in EccKind)
            raise PolicyError(f"ECC event kind {kind!r} is not one of {allowed}") from None
        if not self.checks_enabled or self.only_enabled:
            return HealthAction.IGNORE
        return _ECC_DEFAULTS[ecc]

    def explain_xid(self, xid: int, action: HealthAction | None = None) -> str:
        """The decision on an XID event in words, for its log line: what it does and why.
        `action`: the one already taken (the book's), so it is not worked out again."""
        action = self.classify_xid(xid) if action is None else action
        if action is not HealthAction.IGNORE:
            return self.explain(action)
        env = self._ignored_by_env()
        if env:
            return env
        rule = self.rules.get(xid)
        if rule is None or rule.action is not HealthAction.IGNORE or xid in self.env_ignored:
            return f"ignored: listed in {DISABLE_ENV}"
        if DEFAULT_XID_RULES.get(xid) != rule:
            return "ignored by the config (gpuvisor.health.xids)"
        advice = self.advice_xid(xid, action)
        if advice:
            return f"ignored, the GPU stays in service ({rule.reason}): {advice}"
        return f"ignored as an application error ({rule.reason})"

    def advice_xid(self, xid: int, action: HealthAction | None = None) -> str:
        """The catalog's advice on an XID the default table keeps in service ("" for none): its
        log line is then a warning, for someone should act on it though no device is out.
        `action` as for explain_xid. An XID the operator listed in DP_DISABLE_HEALTHCHECKS gets
        none: they asked for it to be skipped."""
        action = self.classify_xid(xid) if action is None else action
        rule = self.rules.get(xid)
        if (
            action is not HealthAction.IGNORE
            or rule is None
            or self._ignored_by_env()
            or xid in self.env_ignored
        ):
            return ""
        return rule.advice if DEFAULT_XID_RULES.get(xid) == rule else ""

    def explain_ecc(self, kind: EccKind, action: HealthAction | None = None) -> str:
        """The decision on an ECC event in words, for its log line (`action` as for explain_xid)."""
        action = self.classify_ecc(kind) if action is None else action
        if action is not HealthAction.IGNORE:
            return self.explain(action)
        return self._ignored_by_env() or "ignored: corrected by the hardware (a high rate arrives as XID 92)"

    def _ignored_by_env(self) -> str:
        """Why DP_*_HEALTHCHECKS make an ignored event ignored, or "" when they do not."""
        if not self.checks_enabled:
            return f"ignored: health checks are disabled ({DISABLE_ENV})"
        if self.only_enabled:
            return f"ignored: not in {ENABLE_ENV}"
        return ""

    def explain(self, action: HealthAction) -> str:
        """What an action does to a device, in words."""
        if action is HealthAction.TRANSIENT:
            return f"Unhealthy, transient: recovering after {self.quiet_seconds:g}s without a new event and a passing probe"
        if action is HealthAction.UNTIL_RESET:
            return "Unhealthy until the GPU is reset"
        return "ignored"

    def reason_for_xid(self, xid: int) -> str:
        """A short text for logs and device health: `XID 79: GPU has fallen off the bus`."""
        rule = self.rules.get(xid)
        return f"XID {xid}: {rule.reason}" if rule is not None else f"XID {xid}: not in gpuvisor's XID table"

    def describe(self) -> str:
        """One paragraph for the start-up log and `gpuvisor status`."""
        if not self.checks_enabled:
            return f"health checks disabled ({DISABLE_ENV}={self.disable_env!r})"
        lines = [
            f"health checks enabled; transient faults recover after {self.quiet_seconds:g}s quiet and a passing probe"
        ]
        if self.only_enabled:
            lines.append(
                f"only XIDs {_fmt(self.env_enabled)} count ({DISABLE_ENV}=all, {ENABLE_ENV}={self.enable_env!r})"
            )
        else:
            known = set(self.rules) | self.env_ignored
            ignored = sorted(x for x in known if self.classify_xid(x) is HealthAction.IGNORE)
            lines.append(f"ignored XIDs: {_fmt(ignored) if ignored else 'none'}")
            if self.enable_all:
                lines.append(f"every XID counts ({ENABLE_ENV}=all)")
        for action in (HealthAction.TRANSIENT, HealthAction.UNTIL_RESET):
            xids = sorted(x for x in self.rules if self.classify_xid(x) is action)
            lines.append(f"{action.value} XIDs: {_fmt(xids) if xids else 'none'}")
        lines.append(f"other XIDs: {self.unknown_action.value}")
        lines.append(
            f"ECC: double-bit {self.classify_ecc(EccKind.DOUBLE_BIT).value}, "
            f"single-bit {self.classify_ecc(EccKind.SINGLE_BIT).value}"
        )
        lines.extend(self.warnings)
        return "; ".join(lines)


def _fmt(xids: frozenset[int] | list[int]) -> str:
    return ",".join(str(x) for x in sorted(xids))
