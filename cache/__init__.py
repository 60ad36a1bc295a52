"""dbidx.cache"""
