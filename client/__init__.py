"""Engine side: TierClient and engine adapters. Imports nothing of the daemon's."""
