"""dbidx.spark_integration"""
