"""Partners that delete many recipients per request (docs/batch.md): the wire contract
(:mod:`.client`), forming batches (:mod:`.chunker`), sending them under the budget and
settling each operation on its own item's verdict (:mod:`.sender`)."""
