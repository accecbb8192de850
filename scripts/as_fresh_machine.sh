#!/usr/bin/env bash
# as_fresh_machine.sh CMD [ARGS...] - run CMD as on a machine that never ran this project's cluster tier or smoke run:
# SLURM hidden (its commands, config and munge socket; SLURM_* variables unset), and /tmp, /dev/shm and the
# Hugging Face cache empty. scripts/test.sh runs the unit tier so: a unit test that reaches a real SLURM command, or
# reads what an earlier run left in /tmp or the HF cache, fails on every machine, not only on a fresh one.
#
# How: as root, in a private mount namespace (unshare -m; nothing changes outside it), a non-executable stub (mode
# 0644) is bind-mounted over every SLURM and munge command found on PATH or in the sbin folders, so PATH lookups
# (shutil.which, execvp) skip it and running it by its path fails; empty tmpfs mounts cover SLURM's and munge's
# config and socket folders and /dev/shm, and an empty folder covers /tmp. Without root or unshare: each PATH folder
# that holds a SLURM command is replaced on PATH by a folder of links to its other entries, and TMPDIR points at an
# empty folder (absolute paths stay reachable; this says so). Before CMD runs, every SLURM name is looked up again
# as PATH lookups do: if one is still found, this fails instead of running CMD. HF_HOME is an empty folder.
set -euo pipefail
[ $# -gt 0 ] || { echo "usage: $0 CMD [ARGS...]" >&2; exit 2; }

NAMES="sbatch srun scontrol squeue sacct scancel sinfo salloc sattach sstat sacctmgr sreport sprio sshare sdiag
strigger sbcast scrontab sview sh5util sjobexitmod slurmd slurmctld slurmdbd slurmstepd slurmrestd
munge unmunge remunge munged"
DIRS="/etc/slurm /etc/slurm-llnl /run/munge /var/run/munge /run/slurm /var/run/slurm"
SBIN="/usr/sbin /usr/local/sbin /sbin"
me="as_fresh_machine.sh"

scrub_env() {
  local v
  for v in $(compgen -e); do
    case $v in
      SLURM_GRPO_*) ;;
      SLURM_* | SBATCH_* | SALLOC_* | SRUN_* | SQUEUE_* | SACCT_* | SINFO_* | SCONTROL_* | MUNGE_*) unset "$v" ;;
    esac
  done
}

verify_hidden() { # every SLURM name, looked up over PATH as execvp and shutil.which do: none may be runnable
  local n d p left="" path_dirs
  IFS=: read -r -a path_dirs <<< "$PATH"
  for n in $NAMES; do
    for d in "${path_dirs[@]}"; do
      p="${d:-.}/$n"
      [ -d "$p" ] || [ ! -x "$p" ] || left="$left $p"
    done
  done
  for p in ${_FRESH_HIDE_PATHS:-}; do
    [ ! -x "$p" ] || case " $left " in *" $p "*) ;; *) left="$left $p" ;; esac
  done
  if [ -z "$left" ] && command -v python3 > /dev/null; then
    # shellcheck disable=SC2086
    left=$(python3 -c 'import shutil, sys; print(" ".join(filter(None, map(shutil.which, sys.argv[1:]))))' $NAMES)
  fi
  if [ -n "$left" ]; then
    echo "$me: SLURM is still reachable after hiding it:$left; not running the command (a test could reach it)" >&2
    exit 1
  fi
}

if [ "${_FRESH_INNER:-}" = 1 ]; then
  # inside the mount namespace: cover what the outer half found, check, run
  for p in ${_FRESH_HIDE_PATHS:-}; do mount --bind "$_FRESH/stub" "$p"; done
  for d in ${_FRESH_HIDE_DIRS:-}; do mount -t tmpfs -o size=64k,mode=0755 fresh-machine-hidden "$d"; done
  mount -t tmpfs -o mode=1777 fresh-machine-shm /dev/shm
  tops=""
  for k in ${_FRESH_KEEP:-}; do # the checkout (and its venv) when they live in /tmp: back at their own paths
    mkdir -p "$_FRESH/tmp/${k#/tmp/}"
    mount --rbind "$k" "$_FRESH/tmp/${k#/tmp/}"
    t=${k#/tmp/} && tops="$tops ${t%%/*}"
  done
  mount --rbind "$_FRESH/tmp" /tmp
  left=""
  for f in /tmp/* /tmp/.[!.]* /tmp/..?* /dev/shm/* /dev/shm/.[!.]* /dev/shm/..?*; do
    [ -e "$f" ] || [ -L "$f" ] || continue
    case " $tops " in *" ${f#/tmp/} "*) ;; *) left="$left $f" ;; esac
  done
  if [ -n "$left" ]; then
    echo "$me: /tmp or /dev/shm still holds$left after covering them; not running the command" >&2
    exit 1
  fi
  scrub_env
  verify_hidden
  unset _FRESH_INNER _FRESH_HIDE_PATHS _FRESH_HIDE_DIRS _FRESH_KEEP _FRESH
  exec "$@"
fi

# outer half: find what to hide (every match on PATH, and the sbin folders; each file once)
paths="" shown="" dirs=""
add_path() {
  local real
  real=$(readlink -f "$1")
  case " $paths " in *" $real "*) ;; *) paths="$paths $real" shown="$shown $1" ;; esac
}
for n in $NAMES; do
  while IFS= read -r p; do [ -z "$p" ] || add_path "$p"; done < <(type -ap "$n" 2> /dev/null || true)
  for d in $SBIN; do [ ! -x "$d/$n" ] || [ -d "$d/$n" ] || add_path "$d/$n"; done
done
for d in $DIRS; do
  [ -d "$d" ] || continue
  real=$(readlink -f "$d")
  case " $dirs " in *" $real "*) ;; *) dirs="$dirs $real" ;; esac
done
keep=""
for k in "$PWD" "${VIRTUAL_ENV:-}"; do
  k=$([ -n "$k" ] && readlink -f "$k" || true)
  case $k in /tmp/?*) case " $keep " in *" $k "*) ;; *) keep="$keep $k" ;; esac ;; esac
done
for p in $paths $dirs $keep; do
  case $p in *[!A-Za-z0-9_./+-]*) echo "$me: cannot hide $p (a character this script does not pass on)" >&2 && exit 1 ;; esac
done

# the empty folders, outside /tmp (which gets covered): removed when CMD ends
fresh=$(mktemp -d /var/tmp/slurm-grpo-fresh.XXXXXX)
trap 'rm -rf "$fresh"' EXIT
mkdir -m 1777 "$fresh/tmp"
mkdir "$fresh/hf-home"
printf '#!/bin/sh\necho "this command is hidden by scripts/as_fresh_machine.sh: a unit test reached it" >&2\nexit 97\n' > "$fresh/stub"
chmod 0644 "$fresh/stub"
export HF_HOME="$fresh/hf-home"
case ${TMPDIR:-} in /tmp/* | /dev/shm/*) unset TMPDIR ;; esac

why=""
if [ "$(id -u)" != 0 ]; then
  why="not root"
elif ! command -v unshare > /dev/null; then
  why="no unshare (util-linux)"
elif ! unshare -m --propagation private true 2> /dev/null; then
  why="unshare -m is not permitted here"
fi
if [ -z "$why" ]; then
  echo "$me: in a private mount namespace: /tmp, /dev/shm and HF_HOME empty; hidden:${shown:- no SLURM command here}${dirs:+ (and the folders$dirs)}"
  rc=0
  unshare -m --propagation private env _FRESH_INNER=1 _FRESH="$fresh" _FRESH_HIDE_PATHS="$paths" _FRESH_HIDE_DIRS="$dirs" \
    _FRESH_KEEP="$keep" bash "$0" "$@" || rc=$?
  exit $rc
fi

# fallback: PATH without them (each folder that holds one replaced by a folder of links to its other entries)
echo "$me: $why, so no mount namespace: SLURM hidden from PATH lookups only${shown:+ (runnable by absolute path:$shown)};" \
  "/tmp and /dev/shm not covered (TMPDIR and HF_HOME are empty folders)" >&2
export TMPDIR="$fresh/tmp"
new_path="" i=0
IFS=: read -r -a path_dirs <<< "$PATH"
for d in "${path_dirs[@]}"; do
  has=""
  for n in $NAMES; do [ ! -e "$d/$n" ] || has=1; done
  if [ -n "$has" ]; then
    i=$((i + 1))
    m="$fresh/path-$i"
    mkdir "$m"
    # shellcheck disable=SC2046
    find "$d" -mindepth 1 -maxdepth 1 $(for n in $NAMES; do printf -- '! -name %s ' "$n"; done) -exec ln -s -t "$m" {} +
    d=$m
  fi
  new_path="${new_path:+$new_path:}$d"
done
export PATH=$new_path
scrub_env
verify_hidden
rc=0
"$@" || rc=$?
exit $rc
