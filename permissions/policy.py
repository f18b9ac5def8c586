"""Policy: what a principal's store filter is (the ACL entries that grant it access)."""

from __future__ import annotations

from permissions.models import Principal


def store_filter(principal: Principal) -> frozenset[str]:
    """The ACL entries a chunk must carry (any one of) for `principal` to read it.

    Every store applies exactly this set inside its search (Faiss ID selector built from
    the catalog, SQL WHERE in pgvector), and the retriever post-checks each hit with
    `Principal.can_read`, which uses the same set.
    """
    return principal.tokens()
