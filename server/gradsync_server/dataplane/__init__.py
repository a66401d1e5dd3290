"""The coordinator's data plane: the open step, aggregation, step checks, budget and replies.

Pure logic: no grpc, asyncio or prometheus_client (tests/unit/test_core_is_pure.py).
"""
