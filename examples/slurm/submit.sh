#!/bin/bash
# Submit the ingest array and, behind it, the merge. Run from this directory on a login node:
#   RAG_HOME=/shared/project/rag CORPUS=/shared/project/lab-docs ./submit.sh
set -euo pipefail

export RAG_HOME=${RAG_HOME:-/shared/project/rag}
mkdir -p logs

# Create the data directory (and its catalog) once here, so the 8 tasks do not all create it at
# the same moment on a shared file system. It prints the existing collections.
rag collections

# --parsable prints just the job id; sbatch passes this environment (RAG_HOME, CORPUS,
# COLLECTION) on to the jobs.
JOBID=$(sbatch --parsable ingest-array.sbatch)
# afterok on an array job: the merge waits until every task has ended successfully.
sbatch --dependency=afterok:"$JOBID" merge.sbatch
echo "ingest array $JOBID queued, merge behind it; logs in $(pwd)/logs/"
