# Sourced by scripts/demo, scripts/test and scripts/docs: picks the Python they run and
# makes sure the package (with the extras named by the caller) is installed in it.
#
# Which Python, in this order:
#   1. $PYTHON, when set: that interpreter, as it is (nothing is created);
#   2. the activated virtualenv ($VIRTUAL_ENV), when there is one;
#   3. otherwise .venv in the checkout, created with `python3 -m venv .venv` when missing,
#      so that nothing is ever installed into the system's Python.
# The package is installed (editable, with the extras asked for) when it is missing or when
# pyproject.toml changed since the last install into that Python.
#
# Usage: use_python EXTRAS   (e.g. use_python "test"; "" for none); sets PY.

use_python() {
    local extras="$1" spec stamp want sum
    if [ -n "${PYTHON:-}" ]; then
        PY="$PYTHON"
    elif [ -n "${VIRTUAL_ENV:-}" ] && [ -x "$VIRTUAL_ENV/bin/python" ]; then
        PY="$VIRTUAL_ENV/bin/python"
    else
        if [ ! -x .venv/bin/python ]; then
            local base="${PYTHON3:-python3}"
            echo "+ $base -m venv .venv   (a virtualenv for this checkout; activate it with: . .venv/bin/activate)" >&2
            if ! "$base" -m venv .venv; then
                rm -rf .venv
                echo "error: could not create a virtualenv with '$base -m venv .venv'." >&2
                echo "       On Debian or Ubuntu install the venv module first: apt-get install python3-venv" >&2
                echo "       (or set PYTHON=/path/to/python to use an interpreter you prepared yourself)." >&2
                exit 2
            fi
        fi
        PY="$PWD/.venv/bin/python"
    fi
    spec="."
    [ -n "$extras" ] && spec=".[$extras]"
    # What was installed, and from which pyproject.toml: reinstall when either changed.
    stamp="$("$PY" -c 'import sys; print(sys.prefix)')/.celery-delayed-installed"
    # (the package alone is there whenever any extras of the same pyproject.toml were installed).
    sum="$(cksum < pyproject.toml)"
    want="$spec $sum"
    if [ -n "$extras" ]; then
        installed() { grep -qxF -- "$want" "$stamp"; }
    else
        installed() { grep -q -- " $sum\$" "$stamp"; }
    fi
    if [ ! -f "$stamp" ] || ! installed 2>/dev/null || ! "$PY" -c "import celery_delayed" >/dev/null 2>&1; then
        echo "+ $PY -m pip install -e '$spec'" >&2
        "$PY" -m pip install -q --disable-pip-version-check -e "$spec" || exit 2
        echo "$want" >> "$stamp" 2>/dev/null || true
    fi
}
