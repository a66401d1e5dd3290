"""The coordinator's control plane: the job and its components.

Membership, assembly, liveness, persistence, elastic, uneven inputs, collectives,
admission and status. Pure logic: no grpc, asyncio or prometheus_client
(tests/unit/test_core_is_pure.py).
"""
