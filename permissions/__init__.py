"""Principals, ACLs and where they come from (POSIX, sidecar files, explicit fields)."""

from permissions.models import PUBLIC, Principal, make_acl, normalize_entry

__all__ = ["PUBLIC", "Principal", "make_acl", "normalize_entry"]
