"""Tests of the pure health policy (supervisor/health/policy.py): NVIDIA's defaults and env var
semantics, the default XID table, user overrides and input validation."""

from __future__ import annotations

from typing import Any

import pytest

from supervisor.health.policy import (
    DEFAULT_XID_RULES,
    NVIDIA_IGNORED_XIDS,
    EccKind,
    HealthAction,
    HealthPolicy,
    PolicyError,
)

IGN, TRN, RST = HealthAction.IGNORE, HealthAction.TRANSIENT, HealthAction.UNTIL_RESET


def policy(
    disable: str | None = None, enable: str | None = None, table: Any = None, quiet: float = 60.0
) -> HealthPolicy:
    return HealthPolicy.from_settings(disable, enable, table or {}, quiet)


DEFAULTS = [
    (13, IGN), (31, IGN), (43, IGN), (45, IGN), (68, IGN), (109, IGN),  # NVIDIA's default-ignored
    (63, IGN), (92, IGN), (94, IGN), (154, IGN),  # the catalog keeps the GPU in service
    (48, RST), (64, RST), (74, RST), (79, RST), (95, RST), (119, RST), (120, RST),
    (8, RST), (999, RST),  # unknown XIDs: until-reset, as NVIDIA (unhealthy), but recoverable by reset
]  # fmt: skip


@pytest.mark.parametrize(("xid", "action"), DEFAULTS)
def test_default_actions(xid: int, action: HealthAction) -> None:
    """With no env vars and no user table, each XID gets its documented default action."""
    assert policy().classify_xid(xid) is action


def test_default_table_covers_required_xids() -> None:
    """The default table has every XID the design calls out; it ignores NVIDIA's ignore set and the
    XIDs the catalog keeps in service, nothing else."""
    assert {48, 63, 64, 74, 79, 92, 94, 95, 119, 120, 154} <= set(DEFAULT_XID_RULES)
    ignored = {x for x, r in DEFAULT_XID_RULES.items() if r.action is IGN}
    assert ignored - {63, 92, 94, 154} == NVIDIA_IGNORED_XIDS == {13, 31, 43, 45, 68, 109}
    assert {63, 92, 94, 154} <= ignored


# The catalog's immediate actions that leave the GPU in service: no action, restart the
# application, or (XID 154) whatever the XID it reports on calls for.
IN_SERVICE_BUCKETS = {"IGNORE", "RESTART_APP", "XID_154"}


def test_default_actions_follow_the_catalogs_immediate_action() -> None:
    """A default XID whose catalog bucket keeps the GPU in service is ignored; every other one is
    until-reset unless NVIDIA's plugin ignores it by default (drop-in compatibility: 45, 109)."""
    for xid, rule in DEFAULT_XID_RULES.items():
        if rule.bucket in IN_SERVICE_BUCKETS:
            assert rule.action is IGN, (xid, rule)
        elif xid in NVIDIA_IGNORED_XIDS:
            assert rule.action is IGN and xid in (45, 109), (xid, rule)
        else:
            assert rule.action is RST, (xid, rule)
    assert {x: r.bucket for x, r in DEFAULT_XID_RULES.items() if x in (43, 45, 48, 63, 74, 79, 92, 109)} == {
        43: "IGNORE",
        45: "WORKFLOW_XID_45",
        48: "WORKFLOW_XID_48",
        63: "IGNORE",
        74: "WORKFLOW_NVLINK_ERR",
        79: "RESTART_BM",
        92: "IGNORE",
        109: "RESET_GPU",
    }


# (DP_DISABLE_HEALTHCHECKS, DP_ENABLE_HEALTHCHECKS, checks_enabled, {xid: expected action})
ENV_CASES: list[tuple[str, str | None, str | None, bool, dict[int, HealthAction]]] = [
    ("unset", None, None, True, {13: IGN, 48: RST, 94: IGN, 555: RST}),
    ("empty strings", "", "", True, {13: IGN, 48: RST, 555: RST}),
    ("disable all", "all", None, False, {13: IGN, 48: IGN, 79: IGN, 555: IGN}),
    ("disable xids is all", "xids", None, False, {48: IGN, 79: IGN}),
    ("disable ALL upper case", " ALL ", None, False, {48: IGN}),
    ("all anywhere in list", "48,all", None, False, {79: IGN}),
    ("disable list adds to defaults", "48, 79", None, True, {48: IGN, 79: IGN, 13: IGN, 95: RST}),
    ("disable list skips junk", "48,not-a-number,-5,,0", None, True, {48: IGN, 95: RST}),
    ("enable all re-enables defaults", None, "all", True, {13: RST, 31: RST, 109: RST, 94: RST, 555: RST}),
    ("enable all beats disable all", "all", "all", True, {13: RST, 48: RST}),
    ("enable list re-enables default-ignored", None, "13,31", True, {13: RST, 31: RST, 43: IGN}),
    ("enable overrides disable", "11", "11", True, {11: RST}),
    ("enable 109: the catalog's reset", None, "109", True, {109: RST, 13: IGN}),
    ("enable a catalog-ignored XID", None, "94", True, {94: RST, 63: IGN}),
    (
        "disable all, enable list: only those",
        "all",
        "48,94",
        True,
        {48: RST, 94: RST, 79: IGN, 13: IGN, 555: IGN},
    ),
]


@pytest.mark.parametrize(
    ("case", "disable", "enable", "enabled", "expected"), ENV_CASES, ids=[c[0] for c in ENV_CASES]
)
def test_env_var_semantics(
    case: str, disable: str | None, enable: str | None, enabled: bool, expected: dict[int, HealthAction]
) -> None:
    """DP_DISABLE_HEALTHCHECKS / DP_ENABLE_HEALTHCHECKS behave as NVIDIA v0.20.0 (documented intent)."""
    p = policy(disable, enable)
    assert p.checks_enabled is enabled, case
    assert {x: p.classify_xid(x) for x in expected} == expected, case


def test_junk_env_items_are_reported() -> None:
    """Malformed items in the env vars are skipped and listed as warnings naming the variable."""
    p = policy("48,abc", "x7")
    assert any("DP_DISABLE_HEALTHCHECKS" in w and "'abc'" in w for w in p.warnings)
    assert any("DP_ENABLE_HEALTHCHECKS" in w and "'x7'" in w for w in p.warnings)


USER_CASES: list[tuple[str, dict[Any, Any], str | None, str | None, dict[int, HealthAction]]] = [
    ("override default", {94: "until-reset", 79: "transient"}, None, None, {94: RST, 79: TRN}),
    ("ignore a default", {48: "ignore"}, None, None, {48: IGN}),
    ("take a catalog-ignored XID out", {94: "transient"}, None, None, {94: TRN, 63: IGN}),
    ("env enable keeps the table's action", {94: "transient"}, "94", "94", {94: TRN}),
    ("count a default-ignored XID", {13: "transient"}, None, None, {13: TRN}),
    ("map an unknown XID", {555: "ignore", 556: "transient"}, None, None, {555: IGN, 556: TRN}),
    ("string keys and case", {"94": " Until-Reset "}, None, None, {94: RST}),
    ("env disable beats table", {94: "until-reset"}, "94", None, {94: IGN}),
    ("env enable beats table ignore", {94: "ignore"}, None, "94", {94: RST}),
    ("env disable all beats table", {94: "until-reset"}, "all", None, {94: IGN}),
]


@pytest.mark.parametrize(
    ("case", "table", "disable", "enable", "expected"), USER_CASES, ids=[c[0] for c in USER_CASES]
)
def test_user_table(
    case: str,
    table: dict[Any, Any],
    disable: str | None,
    enable: str | None,
    expected: dict[int, HealthAction],
) -> None:
    """The config's XID table overrides defaults; the DP_* env vars apply on top."""
    p = policy(disable, enable, table)
    assert {x: p.classify_xid(x) for x in expected} == expected, case


BAD_SETTINGS: list[tuple[str, dict[str, Any], str]] = [
    (
        "unknown action",
        {"xid_actions": {94: "reboot"}},
        "XID 94: 'reboot' is not one of ignore, transient, until-reset",
    ),
    ("non-string action", {"xid_actions": {94: 3}}, "XID 94"),
    ("zero XID", {"xid_actions": {0: "ignore"}}, "not an XID"),
    ("text XID", {"xid_actions": {"abc": "ignore"}}, "not an XID"),
    ("bool XID", {"xid_actions": {True: "ignore"}}, "not an XID"),
    ("negative quiet", {"quiet_seconds": -1.0}, "quiet period"),
    ("infinite quiet", {"quiet_seconds": float("inf")}, "quiet period"),
    ("text quiet", {"quiet_seconds": "60"}, "quiet period"),
]


@pytest.mark.parametrize(("case", "kwargs", "message"), BAD_SETTINGS, ids=[c[0] for c in BAD_SETTINGS])
def test_bad_settings_are_clear_errors(case: str, kwargs: dict[str, Any], message: str) -> None:
    """Invalid user settings raise PolicyError naming the setting, the value and why."""
    args: dict[str, Any] = {"disable_env": None, "enable_env": None, "xid_actions": {}, "quiet_seconds": 60.0}
    args.update(kwargs)
    with pytest.raises(PolicyError, match=None) as info:
        HealthPolicy.from_settings(**args)
    assert message in str(info.value), case


def test_unknown_action_is_configurable_but_never_ignore() -> None:
    """The fallback for unknown XIDs can be transient; ignore is refused."""
    p = HealthPolicy.from_settings(None, None, {}, 30.0, unknown_action="transient")
    assert p.classify_xid(555) is TRN
    with pytest.raises(PolicyError, match="unknown-XID"):
        HealthPolicy.from_settings(None, None, {}, 30.0, unknown_action="ignore")


ECC_CASES = [
    (None, None, EccKind.DOUBLE_BIT, RST),
    (None, None, EccKind.SINGLE_BIT, IGN),
    (None, None, "double-bit", RST),
    ("all", None, EccKind.DOUBLE_BIT, IGN),
    ("all", "48", EccKind.DOUBLE_BIT, IGN),
    ("all", "all", EccKind.DOUBLE_BIT, RST),
]


@pytest.mark.parametrize(("disable", "enable", "kind", "action"), ECC_CASES)
def test_ecc(disable: str | None, enable: str | None, kind: EccKind | str, action: HealthAction) -> None:
    """Double-bit ECC is until-reset, single-bit is ignored; disabling all checks ignores both."""
    assert policy(disable, enable).classify_ecc(kind) is action


def test_bad_ecc_kind() -> None:
    """An unknown ECC kind is a clear PolicyError."""
    with pytest.raises(PolicyError, match="'triple-bit' is not one of"):
        policy().classify_ecc("triple-bit")


def test_advice_comes_only_from_a_default_rule_that_keeps_the_gpu_in_service() -> None:
    """XID 94 by default carries the catalog's advice (its log line a warning); none once the
    operator took it over (DP_DISABLE_HEALTHCHECKS, a config entry) or for an XID taken out."""
    assert policy().advice_xid(94).endswith("must restart; reset the GPU when convenient")
    assert policy("94").advice_xid(94) == ""
    assert policy(table={94: "transient"}).advice_xid(94) == ""
    assert policy("all").advice_xid(94) == ""
    assert policy().advice_xid(13) == "" and policy().advice_xid(48) == ""


def test_describe_and_reasons() -> None:
    """describe() summarises the merged policy; reason_for_xid names the XID and its meaning."""
    text = policy("48", None, quiet=30).describe()
    assert (
        "30s quiet" in text
        and "ignored XIDs: 13,31,43,45,48,63,68,92,94,109,154" in text
        and "other XIDs: until-reset" in text
    )
    assert "disabled" in policy("all").describe()
    assert "only XIDs 48" in policy("all", "48").describe()
    assert policy().reason_for_xid(79) == "XID 79: GPU has fallen off the bus"
    assert "not in gpuvisor's XID table" in policy().reason_for_xid(555)
