"""The eFCN relax-time protocol (Sec. 6.2.2): its stages (`protocol`), the summaries over seeds (`seeds`), its
figures (`figures`) and `convbias-efcn-protocol` (`command`)."""
