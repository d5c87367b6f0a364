"""Unit tests of the file watches (supervisor/host/watches.py): which events at the config
file's directory count as a change of the config."""

from __future__ import annotations


def test_config_watch_reports_the_file_and_configmap_swaps_but_not_its_neighbours() -> None:
    """Writes to the config file, a rename onto it and ConfigMap `..data` swaps count; a log file
    written beside it does not (a steady stream of those must not hold the check back)."""
    from supervisor.host.inotify import FileSystemEvent as Event
    from supervisor.host.watches import _ConfigEventHandler

    seen: list[int] = []
    handler = _ConfigEventHandler("config.yaml", lambda: seen.append(1))
    handler.on_any_event(Event("modified", "/etc/gv/supervisor.log"))
    handler.on_any_event(Event("opened", "/etc/gv/config.yaml"))
    assert seen == []
    handler.on_any_event(Event("modified", "/etc/gv/config.yaml"))
    handler.on_any_event(Event("moved", "/etc/gv/.config.yaml.swp", "/etc/gv/config.yaml"))
    handler.on_any_event(Event("moved", "/etc/gv/..data_tmp", "/etc/gv/..data"))
    handler.on_any_event(Event("closed", "/etc/gv/config.yaml"))
    assert len(seen) == 4
