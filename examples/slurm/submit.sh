#!/bin/bash
# Submit the ingest array and, behind it, the merge. Run it on a login node, from the directory
# that should hold the logs:
#   RAG_HOME=/shared/project/rag CORPUS=/shared/project/lab-docs COLLECTION=lab ./submit.sh [OPTIONS]
#   ./submit.sh pgvector [OPTIONS]     the pgvector array (ingest-array-pgvector.sbatch), no merge
# OPTIONS go to sbatch for the ingest array and override its #SBATCH lines (sbatch reads its
# command line last), e.g. ./submit.sh --array=1-16 --partition=gpu --time=8:00:00
# MERGE_OPTS does the same for the merge job: MERGE_OPTS="--partition=cpu --mem=8G" ./submit.sh
#
# Logs: ./logs/ (created here; Slurm does not create a log directory, and a task that cannot open
# its log fails at launch).
set -euo pipefail

HERE=$(cd "$(dirname "$0")" && pwd)  # the .sbatch files sit next to this script
store=faiss
if [ "${1:-}" = pgvector ]; then
    store=pgvector
    shift
fi

# ---- Site setup for this login node (the jobs have their own block in the .sbatch files) ---------
# module load python/3.11
# source /shared/project/venvs/rag/bin/activate
# ---------------------------------------------------------------------------------------------------
if ! command -v rag >/dev/null; then
    echo "rag is not on PATH: load its module or activate its venv (see the site setup block of $0)" >&2
    exit 2
fi

export RAG_HOME=${RAG_HOME:-/shared/project/rag}
mkdir -p logs

# Create the data directory (and its catalog) once here, so the tasks do not all create it at
# the same moment on a shared file system. It prints the existing collections.
rag collections

# sbatch passes this environment (RAG_HOME, CORPUS, COLLECTION, PATH with an active venv) on to
# the jobs. --parsable prints the job id (";cluster" after it on a multi-cluster setup).
if [ "$store" = pgvector ]; then
    JOBID=$(sbatch --parsable "$@" "$HERE/ingest-array-pgvector.sbatch")
    echo "pgvector ingest array ${JOBID%%;*} queued (no merge needed); logs in $(pwd)/logs/"
    exit 0
fi
JOBID=$(sbatch --parsable "$@" "$HERE/ingest-array.sbatch")
JOBID=${JOBID%%;*}
read -ra merge_opts <<< "${MERGE_OPTS:-}"  # (the odd expansion below: bash 4.2 with set -u)
# afterok on an array job: the merge waits until every task has ended successfully.
MERGE=$(sbatch --parsable ${merge_opts[@]+"${merge_opts[@]}"} --dependency=afterok:"$JOBID" "$HERE/merge.sbatch")
echo "ingest array $JOBID queued, merge ${MERGE%%;*} behind it; logs in $(pwd)/logs/"
