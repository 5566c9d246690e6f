#!/bin/sh
# Run a command in a cpuacct cgroup of its own (cgroup v1, as root) and print the CPU seconds that it
# and every process it started used (forkserver ranks included), whatever else the machine runs:
#   tests/scripts/cpu_cgroup.sh env PYTHONPATH=$PWD:tests .venv/bin/python -m pytest -p cpu_per_test tests/x.py
# Under it, tests/cpu_per_test.py reads that cgroup too (each test's own CPU, not the machine's).
set -e
group=/sys/fs/cgroup/cpuacct/cpu_cgroup_$$
mkdir "$group"
trap 'rmdir "$group" 2>/dev/null || true' EXIT
echo $$ > "$group/cgroup.procs"
status=0
"$@" || status=$?
echo "cpu_cgroup: $(awk '{printf "%.1f", $1 / 1e9}' "$group/cpuacct.usage") CPU s: $*" >&2
echo $$ > /sys/fs/cgroup/cpuacct/cgroup.procs
exit $status
