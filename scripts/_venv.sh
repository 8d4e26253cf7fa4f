# Sourced by the other scripts: makes .venv with everything the project needs, once, and again
# whenever pyproject.toml changes. Needs only python3 (3.11+) with venv, as on a fresh Debian.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="$root/.venv"
python="${PYTHON:-python3}"
if ! "$python" -c 'import sys; sys.exit(sys.version_info < (3, 11))'; then
    echo "p2pshard needs Python 3.11 or newer; $python is $("$python" --version 2>&1)" >&2
    exit 1
fi
stamp="$venv/.p2pshard-installed"
want="$(sha256sum "$root/pyproject.toml" | cut -d' ' -f1)"
if [ ! -x "$venv/bin/python" ] || [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
    if [ ! -x "$venv/bin/python" ]; then
        if ! "$python" -m venv "$venv"; then
            echo "could not create a virtual environment: on Debian run 'apt-get install python3-venv'" >&2
            exit 1
        fi
    fi
    "$venv/bin/python" -m pip install --quiet --upgrade pip
    "$venv/bin/python" -m pip install --quiet -e "$root[dev]"
    echo "$want" > "$stamp"
fi
export PATH="$venv/bin:$PATH"
cd "$root"
