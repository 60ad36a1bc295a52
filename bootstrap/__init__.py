"""dbidx.bootstrap"""
