"""unit"""
