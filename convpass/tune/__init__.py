"""convpass.tune"""
