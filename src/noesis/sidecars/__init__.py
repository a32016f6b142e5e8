"""Side models beside the decode loop: the runtime (bounded queues, worker threads, cadences,
policies), the sentence embedder and the memory sidecar."""
