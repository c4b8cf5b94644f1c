"""Workers: one per vGPU, the stage server that runs its partition, the backends and the worker-to-worker transports.
"""
