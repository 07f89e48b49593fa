"""convpass.tuning"""
