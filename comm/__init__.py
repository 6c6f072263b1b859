"""Rank bootstrap, process groups and collectives (multi-rank work lands here).

Nothing of ours is imported here; groups built in this package are handed to constructors.
"""
