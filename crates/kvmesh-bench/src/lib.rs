//! Workloads, trace replay, fleet launcher, statistics and reports for kvmesh experiments.
