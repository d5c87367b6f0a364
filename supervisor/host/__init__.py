"""What the supervisor holds on the host's file system and in its service manager.

Owns: `rundir` (the run dir's layout and trust check, atomic writes, the one rule for which
sockets gpuvisor removes), `watches` (the kubelet's plugin dir and the config file's
directory, on `inotify`: watches of one directory, read with no library) and `sdnotify` (systemd's READY/WATCHDOG/STATUS). May import: `common/`.
"""
