#!/usr/bin/env bash
# Install gpuvisor as a systemd service: a dedicated virtual environment in /opt/gpuvisor/venv
# (never the system site-packages: gpuvisor's top-level packages are named common, supervisor
# and worker), the unit, an example config and env file; then `systemctl daemon-reload`.
#
#   install.sh [--prefix DIR] [--no-venv] [--python PYTHON] SOURCE
#
# SOURCE is a gpuvisor wheel or source tree, passed to pip as is. pip reads its own env vars, so an
# offline install is `PIP_NO_INDEX=1 PIP_FIND_LINKS=/path/to/wheels install.sh gpuvisor-*.whl`.
# --prefix DIR stages everything under DIR instead of / and never calls systemctl (for tests and
# packaging checks: a venv is not relocatable, so a staged venv only works where it was made).
# --no-venv installs only the unit, the config and the env file.
# Existing /etc/gpuvisor/config.yaml and /etc/default/gpuvisor are kept, never overwritten.
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
prefix=""
make_venv=1
python=python3
source_arg=""

die() {
    echo "install.sh: $*" >&2
    exit 2
}

usage() {
    echo "install.sh [--prefix DIR] [--no-venv] [--python PYTHON] SOURCE"
}

while [ $# -gt 0 ]; do
    case "$1" in
        --prefix)
            [ $# -ge 2 ] || die "--prefix needs a directory"
            prefix=$2
            shift 2
            ;;
        --prefix=*)
            prefix=${1#--prefix=}
            shift
            ;;
        --no-venv)
            make_venv=0
            shift
            ;;
        --python)
            [ $# -ge 2 ] || die "--python needs an interpreter"
            python=$2
            shift 2
            ;;
        -h | --help)
            echo "usage: $(usage)"
            exit 0
            ;;
        -*)
            die "unknown option $1 (usage: $(usage))"
            ;;
        *)
            [ -z "$source_arg" ] || die "only one SOURCE may be given, got '$source_arg' and '$1'"
            source_arg=$1
            shift
            ;;
    esac
done

if [ -n "$prefix" ]; then
    mkdir -p "$prefix" || die "cannot create the prefix directory $prefix"
    prefix=$(cd "$prefix" && pwd)
elif [ "$(id -u)" -ne 0 ]; then
    die "installing into / needs root (or use --prefix DIR to stage the files)"
fi

venv="$prefix/opt/gpuvisor/venv"
unit_dir="$prefix/etc/systemd/system"
config_dir="$prefix/etc/gpuvisor"
default_dir="$prefix/etc/default"

if [ "$make_venv" -eq 1 ]; then
    [ -n "$source_arg" ] || die "SOURCE (a gpuvisor wheel or source tree) is required unless --no-venv is given"
    [ -e "$source_arg" ] || die "SOURCE $source_arg does not exist"
    command -v "$python" >/dev/null || die "no Python interpreter '$python' (use --python)"
    "$python" -c 'import sys; sys.exit(sys.version_info < (3, 11))' \
        || die "$python is older than Python 3.11, which gpuvisor needs"
    echo "creating the virtual environment $venv"
    mkdir -p "$(dirname "$venv")"
    "$python" -m venv "$venv" || die "'$python -m venv' failed (on Debian/Ubuntu: apt-get install python3-venv)"
    echo "installing $source_arg into it"
    "$venv/bin/python" -m pip install --quiet --disable-pip-version-check --upgrade "$source_arg" \
        || die "pip could not install $source_arg"
    # The code gpuvisor's dataclasses compile, cached beside its bytecode (the unit's
    # ProtectSystem=strict keeps the service from writing it): ~35 ms off every start.
    "$venv/bin/python" -I -m common.methodcache >/dev/null \
        || echo "warning: the dataclass code cache was not written; gpuvisor starts without it" >&2
    "$venv/bin/gpuvisor" --help >/dev/null || die "$venv/bin/gpuvisor does not run after the install"
fi

install -d -m 0755 "$unit_dir" "$config_dir" "$default_dir"
install -m 0644 "$here/gpuvisor.service" "$unit_dir/gpuvisor.service"
echo "installed $unit_dir/gpuvisor.service"
if [ -e "$config_dir/config.yaml" ]; then
    echo "kept the existing $config_dir/config.yaml (the example is $here/config.yaml)"
else
    install -m 0644 "$here/config.yaml" "$config_dir/config.yaml"
    echo "installed $config_dir/config.yaml"
fi
if [ -e "$default_dir/gpuvisor" ]; then
    echo "kept the existing $default_dir/gpuvisor"
else
    install -m 0644 "$here/gpuvisor.env" "$default_dir/gpuvisor"
    echo "installed $default_dir/gpuvisor"
fi

if [ -n "$prefix" ]; then
    echo "staged under $prefix; systemctl was not called"
elif [ -d /run/systemd/system ]; then
    systemctl daemon-reload
    echo "done: start it with 'systemctl enable --now gpuvisor'"
else
    echo "systemd is not running here: run 'systemctl daemon-reload' on the target system"
fi
