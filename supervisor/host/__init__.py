"""What the supervisor holds on the host's file system and in its service manager.

Owns: `rundir` (the run dir's layout and trust check, its all-or-none plan writes, the one rule
for which sockets gpuvisor removes), `watches` (inotify on the kubelet's plugin dir and on the config
file) and `sdnotify` (systemd's READY/WATCHDOG/STATUS). May import: `common/`.
"""
