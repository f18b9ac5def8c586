"""Preloaded by the parse pool's forkserver (`ingest.parse_pool`): importing it warms the parsers.

Only the forkserver imports this module; its import side effect is the point, so that every parse
worker forked from that server starts with the parsers imported and initialized.
"""

from ingest.parse_warm import warm_parsers

WARMED = warm_parsers()
