"""The flush: shard drain, epochs, quarantine, settling, layouts, fences, bounded waits."""
