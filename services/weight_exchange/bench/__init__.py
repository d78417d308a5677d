"""Weight-exchange benchmark: real ranks as processes (`runner`), paper-scale plans without memory (`simulate`)."""
