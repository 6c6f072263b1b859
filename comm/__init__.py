"""Rank bootstrap, process groups and collectives for jobs launched by mpirun.

Nothing of ours is imported here; groups built in this package are handed to constructors.
"""
from comm.bootstrap import RankInfo, bootstrap, shutdown
from comm.collectives import all_gather, all_gather_json, all_reduce, all_to_all, exchange_counts
from comm.groups import Group, ParallelGroups

__all__ = ["RankInfo", "bootstrap", "shutdown", "Group", "ParallelGroups", "all_reduce", "all_gather", "all_gather_json", "all_to_all",
           "exchange_counts"]
